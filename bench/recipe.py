"""andrea's recipes against the anchor (issue 54's setup): gpt2+AdamW, modern+Muon, modern+NorMuon and andrea's best,
modern+NorMuon with value embeddings and smear (the modern presets' parts), on the same tokens, held-out loss at step 300 and steps to nanoGPT's final loss, beside nanochat's figures measured elsewhere.

The setup: a 4-layer, 4-head, n_embd-128, block-128 model; a 4,096-token BPE prepared by andrea's data module from
the embedded arms (as `andrea prepare --preset andrea-tiny --set model.vocab_size=4096`, into a temporary directory);
300 batches of 16 × 128 tokens, each row `store.rows` over the arms with numpy.random.default_rng(1337), each row's
arm uniform; 10 held-out batches the same way from default_rng(1338) on the val split; warmup 15 steps, cosine to
lr/10 at step 300 (the wsd row: lr held, then a linear warmdown over the last 65 % to lr/20, nanochat's). Every run
is andrea's own Trainer (`--kernels torch`, one thread); each subject's best of a three-point sweep is its row.
The held-out loss is read every 5 steps to step 100, every 25 after: "steps to 5.018" interpolates linearly between
the two reads around the crossing ("-" if never).

    python bench/recipe.py --jobs 3        # the sweeps and the table (15 runs of ~200 s of one idle core each)
    python bench/recipe.py --quick         # smoke: a tiny shape, 12 steps, two-point sweeps (seconds)
    python bench/recipe.py --json out.json # also every curve
    python bench/recipe.py --ablation --jobs 2   # modern+NorMuon at muon_lr 0.06 with each model extra alone
    python bench/recipe.py --only modern+NorMuon+softcap+relu2 --grid modern+NorMuon+softcap+relu2=0.04,0.06
    python bench/recipe.py --ablation --step-cost 10   # CPU time per step only, the subjects interleaved
    python bench/recipe.py --size 12m --ablation --only modern+NorMuon modern+NorMuon+ve+smear --jobs 2
                                                       # at andrea-12m-modern's model (M12: 8 x 256 tokens a batch)
    python bench/recipe.py --size wide --only modern+NorMuon+ve+smear --grid modern+NorMuon+ve+smear=0.02,0.03,0.04
                                                       # M12's tokens at andrea-120m-modern's width, 2 layers
    python bench/recipe.py --size 12m-gpu --device cuda --only modern+NorMuon+ve+smear \
        --grid modern+NorMuon+ve+smear=0.03,0.04,0.06  # the 12m preset's muon_lr on a GPU at its own batch

A subject named "<subject>+<extra>+<extra>…" is that subject with those model extras on (EXTRAS: nanochat's, each a
ModelConfig key, andrea/model/modern.py: softcap, embed_norm, rope1e5, qk1.2, relu2, and the parts with parameters
ve, lambdas, smear, backout); the ablation table gives each one's held-out loss at the last step, its
change against the plain subject's (run alongside, else the size's measured baseline), steps to 5.018 and its CPU
seconds per step relative to the plain subject's (process time, so a machine shared with other work counts less).

Last, the modern presets' learning rates (PRESETS: their muon_lr beside the sweep's best for their recipe, and the
AdamW groups' peak lrs their update computes at their width).

Reads the embedded arms; writes the markdown report to stdout. Losses are a pure function of the seed on one
machine. The anchors' rows are constants (ANCHORS), measured outside the project by issue 54 on the same setup.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from andrea.config.load import from_dict, load as load_config  # noqa: E402
from andrea.control.run.trainer import Trainer  # noqa: E402
from andrea.data.store import prepare, rows  # noqa: E402
from andrea.optim.normuon import group_hyper  # noqa: E402
from andrea.optim.registry import Hyper  # noqa: E402

TARGET = 5.018  # nanoGPT's final held-out loss on this setup (issue 54)
ANCHORS = [  # (who, final held-out loss, steps to 5.018): measured elsewhere (issue 54, main at a879c10, CPU)
    ("nanoGPT, GPT + AdamW (measured elsewhere)", 5.018, 300),
    ("andrea's model with nanochat's optimizer and groups (measured elsewhere)", 3.888, 61),
    ("**nanochat** (its model, MuonAdamW, base_train.py's scaling and schedules; measured elsewhere)", 3.712, 49),
]


@dataclass(frozen=True)
class Size:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    batch_size: int
    steps: int
    warmup: int
    held_out: int
    max_bytes: int  # data.max_bytes_per_arm (andrea-tiny's)
    lr_scale: float = 1.0  # on the subjects' fixed AdamW lr (embedding, head, scalars), tuned at n_embd 128
    anchors: bool = True  # print the anchors' rows (measured at FULL; QUICK's smoke prints them too)
    baseline: float | None = None  # ABLATED's loss at muon_lr 0.06 here (docs/benchmarks.md), when not rerun


FULL = Size(4, 4, 128, 128, 4096, 16, 300, 15, 10, 300_000, baseline=3.710)
QUICK = Size(1, 2, 32, 32, 300, 4, 12, 2, 2, 60_000)
# andrea-12m-modern's model (6 layers, 5 heads, n_embd 320, block 256, vocab 8,192) on what one CPU core trains in
# minutes: 8 sequences a batch (the preset's 32 is a GPU's), 300 steps, a megabyte of each arm; the AdamW lr
# scaled by sqrt(128 / 320), as nanochat scales it with width (the preset's comment), Muon's unscaled
M12 = Size(6, 5, 320, 256, 8192, 8, 300, 15, 10, 1_000_000, lr_scale=(128 / 320) ** 0.5, anchors=False,
           baseline=4.018)
# andrea-120m-modern's width (n_embd 768, 12 heads of 64) at 2 layers, on M12's tokens (the same vocabulary, batches and
# held-out windows: its losses compare with M12's rows): NorMuon's best muon_lr at the 120m preset's width, in
# 45 minutes of a CPU core a run; the AdamW groups at nanochat's own lrs (width 768)
WIDE = replace(M12, n_layer=2, n_head=12, n_embd=768, lr_scale=(128 / 768) ** 0.5, baseline=None)
# andrea-12m-modern as its preset trains it, for a GPU (`--device cuda`, issue 57's sweep): its 32 sequences a batch,
# 2,000 steps (65 M tokens) over 8 MB of each arm, warmup 100, 20 held-out batches; minutes of an H100 a run
GPU12 = replace(M12, batch_size=32, steps=2000, warmup=100, held_out=20, max_bytes=8_000_000, baseline=None)
SIZES = {"bench": FULL, "12m": M12, "wide": WIDE, "12m-gpu": GPU12}
EXTRAS = {  # name -> the model keys it sets: nanochat's extras (issue 54)
    "softcap": {"logit_softcap": 15.0}, "embed_norm": {"embed_norm": True}, "rope1e5": {"rope_base": 1e5},
    "qk1.2": {"qk_scale": 1.2}, "relu2": {"mlp": "relu2"},
    # nanochat's parts with parameters (their own AdamW groups under NorMuon: andrea/optim/normuon.py PARTS)
    "ve": {"value_embeds": True}, "lambdas": {"resid_lambdas": True}, "smear": {"smear": True},
    "backout": {"backout": True},
}
ABLATED = "modern+NorMuon"  # the subject --ablation adds each extra to, at muon_lr 0.06 (its best point)
NORMUON = {"optimizer": "normuon", "grad_clip": 0.0, "muon_momentum": 0.97, "muon_weight_decay": 0.1}
# subject -> (arch, fixed train keys, the swept key, its full grid, its quick grid)
SUBJECTS = {
    "gpt2+AdamW": ("gpt2", {}, "lr", [1e-3, 2e-3, 4e-3], [1e-3, 4e-3]),
    "modern+Muon": ("modern", {"optimizer": "muon", "lr": 8e-3}, "muon_lr", [0.01, 0.02, 0.04], [0.01, 0.04]),
    "modern+NorMuon": ("modern", {**NORMUON, "lr": 8e-3}, "muon_lr", [0.03, 0.06, 0.09], [0.02, 0.04]),
    "modern+NorMuon, wsd": ("modern", {**NORMUON, "lr": 8e-3, "schedule": "wsd"}, "muon_lr", [0.03, 0.06, 0.09],
                            [0.02, 0.04]),
}


BEST = "modern+NorMuon+ve+smear"  # andrea's best recipe at this setup (docs/benchmarks.md): the modern presets' parts
DEFAULT = [*SUBJECTS, BEST]  # what a run without --only or --ablation sweeps


def subject(name: str) -> tuple:
    """SUBJECTS' entry, the "+extra" suffixes of `name` (EXTRAS) added as model keys:
    (arch, fixed train keys, model keys, swept key, full grid, quick grid)."""
    base, extras = name, []
    while base not in SUBJECTS and "+" in base:
        base, extra = base.rsplit("+", 1)
        extras.insert(0, extra)
    if base not in SUBJECTS or any(e not in EXTRAS for e in extras):
        raise SystemExit(f"recipe.py: {name!r}: not a subject ({', '.join(SUBJECTS)}) with extras from "
                         f"{', '.join(EXTRAS)}")
    arch, fixed, key, full, quick = SUBJECTS[base]
    model = {k: v for e in extras for k, v in EXTRAS[e].items()}
    return arch, fixed, model, key, full, quick


def config(size: Size, arch: str, fixed: dict, key: str, value: float, model_keys: dict | None = None):
    fixed = {**fixed, "lr": fixed["lr"] * size.lr_scale} if "lr" in fixed else fixed
    train = {"batch_size": size.batch_size, "warmup_steps": size.warmup, "lr_decay_steps": size.steps,
             "steps": size.steps, **fixed, key: value}
    lr = train.get("lr", 6e-4)
    train["min_lr"] = lr / 20 if train.get("schedule") == "wsd" else lr / 10
    if train.get("schedule") == "wsd":
        train["warmdown_steps"] = round(0.65 * size.steps)
    model = {"arch": arch, "n_layer": size.n_layer, "n_head": size.n_head, "n_embd": size.n_embd,
             "block_size": size.block_size, "vocab_size": size.vocab_size, **(model_keys or {})}
    return from_dict({"model": model, "train": train, "data": {"max_bytes_per_arm": size.max_bytes}})


def tokens(size: Size) -> tuple[list, list]:
    """The setup's tokens, the same for every subject: the arms prepared once in a scratch folder, then the training
    batches (`default_rng(1337)`) and the held-out ones (`default_rng(1338)`, the val split)."""
    with tempfile.TemporaryDirectory() as tmp:
        _, arms = prepare(config(size, "gpt2", {}, "lr", 1e-3).data, Path(tmp), size.vocab_size, size.block_size)
        return batches(arms, size, size.steps, 1337, "train"), batches(arms, size, size.held_out, 1338, "val")


def batches(arms, size: Size, n: int, seed: int, split: str):
    rng = np.random.default_rng(seed)
    return [rows(arms, rng.integers(0, len(arms), size.batch_size), size.block_size, rng, split) for _ in range(n)]


def reads(steps: int) -> list[int]:
    return sorted({s for s in range(0, steps + 1) if (s <= 100 and s % 5 == 0) or s % 25 == 0} | {steps})


def train_run(job) -> dict:
    cfg, train_batches, held_out, steps, device = job  # steps: where the run stops (the schedule's horizon is cfg's)
    torch.set_num_threads(1)
    trainer = Trainer(cfg, torch.device(device), kernels="torch" if device == "cpu" else "triton")
    wanted, curve, t0, cpu = set(reads(steps)), [], time.perf_counter(), 0.0
    for step in range(steps + 1):
        if step in wanted:
            curve.append((step, sum(float(trainer.loss_of(x, y)) for x, y in held_out) / len(held_out)))
        if step < steps:
            c0 = time.process_time()
            trainer.train_step(step, *train_batches[step])
            cpu += time.process_time() - c0
    print(f"{cfg.model.arch} {cfg.train.optimizer} {cfg.train.schedule} lr {cfg.train.lr:g} muon_lr "
          f"{cfg.train.muon_lr:g}: {curve[-1][1]:.3f} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return {"curve": curve, "final": curve[-1][1], "seconds": time.perf_counter() - t0, "cpu_per_step": cpu / steps}


def steps_to(curve: list[tuple[int, float]], target: float) -> float | None:
    for (s0, l0), (s1, l1) in zip(curve, curve[1:]):
        if l1 <= target < l0:
            return s0 + (l0 - target) / (l0 - l1) * (s1 - s0)
    return None


def _extras_of(name: str) -> list[str]:
    """The "+extra" suffixes of a subject's name (EXTRAS), in order."""
    parts = name.split("+")
    return [p for p in parts if p in EXTRAS]


def ablation_table(sweeps: dict[str, list[dict]], size: Size) -> str:
    """Markdown: each subject with extras (its best point) against its plain subject: held-out loss at the last
    step, the change (negative: better), steps to TARGET, CPU seconds per step relative to the plain subject's."""
    lines = [f"| extras | muon_lr | held-out loss at step {size.steps} | change | steps to {TARGET} | "
             f"CPU time per step |", "|---|---|---|---|---|---|"]
    for name, runs in sweeps.items():
        extras = _extras_of(name)
        base_name = name.split("+" + extras[0])[0] if extras else name
        best = min(runs, key=lambda r: r["final"])
        base_runs = sweeps.get(base_name)
        base = min(base_runs, key=lambda r: r["final"]) if base_runs else None
        ref = base["final"] if base else (size.baseline if base_name == ABLATED else None)
        cost = f"{best['cpu_per_step'] / base['cpu_per_step']:.2f}×" if base else "-"
        change = "-" if ref is None else f"{best['final'] - ref:+.3f}"
        reach = steps_to(best["curve"], TARGET)
        lines.append(f"| {'+'.join(extras) or 'none (' + name + ')'} | {best['value']:g} | {best['final']:.3f} | "
                     f"{change} | {'-' if reach is None else f'{reach:.0f}'} | {cost} |")
    return "\n".join(lines)


PRESETS = ("andrea-12m-modern", "andrea-120m-modern")


def preset_table(sweeps: dict[str, list[dict]]) -> str:
    """Markdown: the modern presets' peak learning rates beside the sweeps' best for their recipe. Muon's lr carries
    over from the bench's width (its update is orthogonalised and shape-scaled); the AdamW groups' lrs are the ones
    the preset's update computes at its width (normuon's `group_hyper`, muon's train.lr)."""
    lines = ["| preset | optimizer | muon_lr | the sweep's best muon_lr (its subject) | AdamW peak lr at its width |",
             "|---|---|---|---|---|"]
    for name in PRESETS:
        cfg = load_config(preset=name)
        tc, width = cfg.train, cfg.model.n_embd
        base = "modern+NorMuon" if tc.optimizer == "normuon" else "modern+Muon"
        recipe = base + "".join(f"+{e}" for e, keys in EXTRAS.items()
                                if all(getattr(cfg.model, k) == v for k, v in keys.items()))
        runs = sweeps.get(recipe)
        best = f"{min(runs, key=lambda r: r['final'])['value']:g} ({recipe})" if runs else f"not swept here ({recipe})"
        if tc.optimizer == "normuon":
            hp = Hyper(0, tc.lr, tc.beta1, tc.beta2, tc.eps, tc.weight_decay, None)
            groups = ("embed", "head", "value_embed") if cfg.model.value_embeds else ("embed", "head")
            adamw = ", ".join(f"{g} {group_hyper(g, tc, width, hp)['lr']:.3g}" for g in groups)
        else:
            adamw = f"embed and head {tc.lr:g} (train.lr)"
        lines.append(f"| {name} | {tc.optimizer} | {tc.muon_lr:g} | {best} | {adamw} |")
    return "\n".join(lines)


def step_costs(cfgs: dict[str, object], train_batches, steps: int, rounds: int = 3) -> dict[str, float]:
    """Median CPU seconds per training step of each configuration, measured in this one process, the subjects
    interleaved round by round (`steps` steps each per round, after one untimed step), so the machine's load
    weighs on all of them alike: runs timed apart on a shared machine differ by ±15 % for identical math."""
    torch.set_num_threads(1)
    trainers = {name: Trainer(cfg, torch.device("cpu"), kernels="torch") for name, cfg in cfgs.items()}
    for t in trainers.values():
        t.train_step(0, *train_batches[0])
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for _ in range(rounds):
        for name, t in trainers.items():
            c0 = time.process_time()
            for step in range(1, steps + 1):
                t.train_step(step, *train_batches[step])
            times[name].append((time.process_time() - c0) / steps)
    return {name: sorted(v)[len(v) // 2] for name, v in times.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny shape, 12 steps, two-point sweeps")
    parser.add_argument("--size", choices=SIZES, default="bench",
                        help="bench: issue 54's setup (the anchors' rows); 12m: andrea-12m-modern's model, 8 x 256 "
                             "tokens a batch (no anchor measured there); wide: 12m's tokens at andrea-120m-modern's "
                             "width (768), 2 layers; 12m-gpu: andrea-12m-modern's batch of 32, 2,000 steps "
                             "(with --device cuda)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="cuda: the runs on the GPU with andrea's Triton kernels, one at a time (--jobs 1)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    parser.add_argument("--json", type=Path, help="also write every curve here")
    parser.add_argument("--only", nargs="*", help="these subjects only")
    parser.add_argument("--grid", action="append", default=[], metavar="SUBJECT=V1,V2",
                        help="sweep SUBJECT over these values instead (a machine too busy for the whole sweep)")
    parser.add_argument("--ablation", action="store_true",
                        help=f"{ABLATED} and {ABLATED}+<extra> for each extra (or the --only subjects), at muon_lr "
                             f"0.06 (quick: 0.04)")
    parser.add_argument("--step-cost", type=int, metavar="STEPS",
                        help="instead of training: each subject's CPU time per step (its first grid value), "
                             "interleaved in one process, three rounds of STEPS steps")
    parser.add_argument("--until", type=int, metavar="STEP",
                        help="stop every run at this step (the schedule unchanged): the curve's start, its steps to "
                             f"{TARGET} and the step cost, for a fraction of the time")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("recipe.py: --device cuda: no CUDA device here")
    size = QUICK if args.quick else SIZES[args.size]
    names = args.only or ([] if args.ablation else DEFAULT)
    if args.ablation and not args.only:
        names += [ABLATED] + [f"{ABLATED}+{e}" for e in EXTRAS]
    subjects = {name: subject(name) for name in names}
    if args.ablation:
        for name in subjects:
            if name.startswith(ABLATED):
                subjects[name] = subjects[name][:4] + ([0.06], [0.04])
    for item in args.grid:
        name, values = item.split("=")
        grid = [float(x) for x in values.split(",")]
        subjects[name] = (subjects.get(name) or subject(name))[:4] + (grid, grid)
    train_batches, held_out = tokens(size)
    if args.step_cost:
        first = {name: config(size, arch, fixed, key, (quick if args.quick else full)[0], model)
                 for name, (arch, fixed, model, key, full, quick) in subjects.items()}
        costs = step_costs(first, train_batches, args.step_cost)
        ref = next(iter(costs.values()))
        print("| subject | CPU seconds per step | relative to the first |\n|---|---|---|")
        for name, c in costs.items():
            print(f"| {name} | {c:.3f} | {c / ref:.2f}× |")
        return 0
    stop = min(args.until or size.steps, size.steps)
    jobs = [(name, value, (config(size, arch, fixed, key, value, model), train_batches, held_out, stop, args.device))
            for name, (arch, fixed, model, key, full, quick) in subjects.items()
            for value in (quick if args.quick else full)]
    # cuda: one process at a time, forked before this one touches the device
    with ProcessPoolExecutor(1 if args.device == "cuda" else args.jobs) as pool:
        results = list(pool.map(train_run, [j for _, _, j in jobs]))
    sweeps: dict[str, list[dict]] = {}
    for (name, value, _), r in zip(jobs, results):
        sweeps.setdefault(name, []).append({"value": value, **r})
    size = replace(size, steps=stop)  # the table's "at step": where the runs stopped
    print(f"| who | swept | final held-out loss (sweep) | best | held-out loss at step {size.steps} | steps to "
          f"{TARGET} |")
    print("|---|---|---|---|---|---|")
    for name, runs in sweeps.items():
        key = subjects[name][3]
        best = min(runs, key=lambda r: r["final"])
        reach = steps_to(best["curve"], TARGET)
        swept = ", ".join(f"{r['value']:g}" for r in runs)
        finals = ", ".join(f"{r['final']:.3f}" for r in runs)
        reached = "-" if reach is None else f"{reach:.0f}"
        print(f"| andrea, {name} | {key} {swept} | {finals} | {key} {best['value']:g} | {best['final']:.3f} | "
              f"{reached} |")
    for who, loss, steps in (ANCHORS if size.anchors else []):
        print(f"| {who} | | | | {loss:.3f} | {steps} |")
    if any(_extras_of(name) for name in sweeps):
        print()
        print(ablation_table(sweeps, size))
    print()
    print(preset_table(sweeps))
    if args.json:
        args.json.write_text(json.dumps({"size": size.__dict__, "sweeps": sweeps}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
