"""The 2026 recipe against the 2019 one: gpt2+AdamW, modern+AdamW and modern+Muon on the embedded corpus.

Three subjects train the same small model size (a custom shape, not a preset: it trains in minutes on 2 CPU cores)
on the same tokens, batch and steps, each at its best learning rate from a small sweep that is printed:
- gpt2+AdamW    model.arch = "gpt2", train.optimizer = "adamw": the contract's model (andrea/model/gpt.py);
- modern+AdamW  model.arch = "modern" (andrea/model/modern.py: rotary, RMSNorm, QK-norm, SwiGLU, no biases);
- modern+Muon   the modern model with train.optimizer = "muon" (andrea/optim/muon.py); its sweep is over
                train.muon_lr, with train.lr (AdamW's, on the embeddings and the head) at modern+AdamW's best.
Every run is andrea's own Trainer (andrea/control/run/trainer.py, `--kernels torch`), with andrea's schedule: linear warmup
over the first 5 % of the steps, cosine decay to lr/10 at the last step; every other key at its default.
The held-out loss is the mean over fixed held-out windows (the same for every run), every `--eval-every` steps.
A subject's best run is the one with the lowest final held-out loss.

Printed: the sweep, then per subject its final held-out loss, the steps it needs to reach gpt2+AdamW's final
held-out loss (the first eval at or below it, interpolated linearly between the two evals around the crossing;
"-" if it never does) and that over gpt2+AdamW's steps, and its per-step wall time over gpt2+AdamW's. The step
times come from a separate interleaved phase (`--time-steps` steps of each subject's best configuration, one
subject after the other within each step, the order reversed every step, as bench/train.py): a shared machine
slows all three alike; the median step time and its interquartile range are printed with the load average.
The same phase runs again at `--time-batch-scale` times the batch (default 4): Muon's orthogonalisation costs the
same per step whatever the batch, the forward and backward grow with it, so the second ratio shows how much of
the first is a fixed per-step cost that a real run's batch (hundreds of thousands of tokens) makes negligible.
Targets (issue 45): modern+Muon reaches gpt2+AdamW's final loss in <= 0.65x the steps, at <= 1.15x the step time.

    python bench/recipe.py --jobs 3          # ~2 min on 2 idle CPU cores; the plot in bench/out/recipe.png
    python bench/recipe.py --quick           # smoke: a tiny shape, 12 steps, two-point sweeps (seconds)
    python bench/recipe.py --json out.json   # also every curve and step time

Reads the embedded arms (prepared once into a temporary directory, removed); writes the plot and the markdown
report to stdout. Losses are a pure function of the seed on one machine; the timings describe the machine.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
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

from andrea.config.load import from_dict  # noqa: E402
from andrea.data.store import prepare, rows  # noqa: E402
from andrea.control.run.trainer import Trainer  # noqa: E402

BASELINE = "gpt2+AdamW"
STEP_TARGET, TIME_TARGET = 0.65, 1.15


@dataclass(frozen=True)
class Size:
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    vocab_size: int
    batch_size: int
    steps: int
    eval_every: int
    eval_batches: int
    max_bytes: int  # data.max_bytes_per_arm


FULL = Size(n_layer=2, n_head=1, n_embd=64, block_size=128, vocab_size=1024, batch_size=8, steps=300,
            eval_every=20, eval_batches=4, max_bytes=1_000_000)
QUICK = Size(n_layer=1, n_head=2, n_embd=32, block_size=32, vocab_size=300, batch_size=4, steps=12, eval_every=4,
             eval_batches=2, max_bytes=60_000)
# (subject, arch, optimizer, the swept key, its grid)
SWEEPS = {"full": [(BASELINE, "gpt2", "adamw", "lr", [1e-3, 2e-3, 4e-3]),
                   ("modern+AdamW", "modern", "adamw", "lr", [4e-3, 8e-3, 1.6e-2]),
                   ("modern+Muon", "modern", "muon", "muon_lr", [0.01, 0.02, 0.04])],
          "quick": [(BASELINE, "gpt2", "adamw", "lr", [1e-3, 4e-3]),
                    ("modern+AdamW", "modern", "adamw", "lr", [1e-3, 4e-3]),
                    ("modern+Muon", "modern", "muon", "muon_lr", [0.01, 0.04])]}


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The step at which a held-out curve [(step, loss)] first reaches `target`, linear between the two evals around
    the crossing (the first eval's step if it is already there); None if it never does."""
    for i, (step, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return float(step)
            (s0, l0) = curve[i - 1]
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
    return None


def best(runs: list[dict]) -> dict:
    """The run with the lowest final held-out loss (a diverged run's NaN never wins)."""
    return min(runs, key=lambda r: r["curve"][-1][1] if np.isfinite(r["curve"][-1][1]) else float("inf"))


def config(size: Size, arch: str, optimizer: str, lr: float, muon_lr: float | None = None):
    train = {"batch_size": size.batch_size, "steps": size.steps, "lr": lr, "min_lr": lr / 10,
             "warmup_steps": max(1, size.steps // 20), "lr_decay_steps": size.steps, "optimizer": optimizer}
    if muon_lr is not None:
        train["muon_lr"] = muon_lr
    model = {"arch": arch, "n_layer": size.n_layer, "n_head": size.n_head, "n_embd": size.n_embd,
             "block_size": size.block_size, "vocab_size": size.vocab_size}
    return from_dict({"model": model, "train": train, "data": {"max_bytes_per_arm": size.max_bytes}})


def batches(arms, size: Size, n: int, seed: int, split: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n batches of random windows, every arm equally likely: the same list for every subject."""
    rng = np.random.default_rng(seed)
    return [rows(arms, rng.integers(0, len(arms), size.batch_size), size.block_size, rng, split) for _ in range(n)]


def train_run(cfg, train_batches, held_out, eval_every: int) -> list[tuple[int, float]]:
    """Train from step 0 on `train_batches`; the held-out curve [(step, mean loss)] from step 0 on."""
    trainer = Trainer(cfg, torch.device("cpu"))

    def held() -> float:
        return float(np.mean([float(trainer.loss_of(x, y)) for x, y in held_out]))
    curve = [(0, held())]
    for step, (x, y) in enumerate(train_batches):
        trainer.train_step(step, x, y)
        if (step + 1) % eval_every == 0 or step + 1 == len(train_batches):
            curve.append((step + 1, held()))
    trainer._wait_snapshot()
    return curve


def _threads(n: int) -> None:
    torch.set_num_threads(n)


def sweep(pool: ProcessPoolExecutor | None, cfgs: list, train_batches, held_out, eval_every: int) -> list:
    """The held-out curve of every configuration: in the pool's processes (one run each, in parallel), or here."""
    if pool is None:
        return [train_run(cfg, train_batches, held_out, eval_every) for cfg in cfgs]
    futures = [pool.submit(train_run, cfg, train_batches, held_out, eval_every) for cfg in cfgs]
    return [f.result() for f in futures]


def time_steps(cfgs: dict, train_batches, n: int) -> dict[str, list[float]]:
    """Seconds per train_step of each configuration, interleaved (ABC, CBA, ...) on the same batches."""
    trainers = {name: Trainer(cfg, torch.device("cpu")) for name, cfg in cfgs.items()}
    names, times = list(trainers), {name: [] for name in trainers}
    for step in range(n + 2):  # two warm-up steps, not timed
        x, y = train_batches[step % len(train_batches)]
        for name in names if step % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            trainers[name].train_step(step, x, y)
            if step >= 2:
                times[name].append(time.perf_counter() - t0)
    return times


def scaled_batch(cfgs: dict, train_batches, scale: int) -> tuple[dict, list]:
    """The configurations at `scale` times the batch, and batches of `scale` consecutive training batches each."""
    big = {n: replace(c, train=replace(c.train, batch_size=c.train.batch_size * scale)) for n, c in cfgs.items()}
    groups = [train_batches[i:i + scale] for i in range(0, len(train_batches) - scale + 1, scale)]
    return big, [(torch.cat([x for x, _ in g]), torch.cat([y for _, y in g])) for g in groups]


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return q[0], statistics.median(xs), q[2]


def plot(results: dict, target: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        steps, losses = zip(*r["best"]["curve"])
        ax.plot(steps, losses, label=f"{name} ({r['key']} {r['best']['value']:g})")
    ax.axhline(target, color="gray", lw=0.8, ls="--", label=f"{BASELINE} final {target:.3f}")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss")
    first = [r["best"]["curve"][1][1] for r in results.values() if len(r["best"]["curve"]) > 1]
    if first:
        ax.set_ylim(top=max(first) + 0.2)  # the step-0 loss (ln V) would flatten the curves
    ax.legend()
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke: a tiny shape, 12 steps, two-point sweeps")
    ap.add_argument("--steps", type=int, help="override the size's steps")
    ap.add_argument("--time-steps", type=int, help="interleaved timed steps per subject (default 40; quick 3)")
    ap.add_argument("--time-batch-scale", type=int, default=4, help="time the best configurations again at this "
                    "times the batch (0: not)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run (1: steadier on a shared machine)")
    ap.add_argument("--jobs", type=int, default=1, help="sweep runs trained at once, each in its own process (the "
                    "losses are the same as one at a time: each run is single-process and seeded)")
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--plot", default=str(ROOT / "bench" / "out" / "recipe.png"))
    ap.add_argument("--json")
    args = ap.parse_args()
    size = QUICK if args.quick else FULL
    if args.steps:
        size = Size(**{**vars(size), "steps": args.steps})
    time_n = args.time_steps or (3 if args.quick else 40)
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="andrea-recipe-") as tmp:
        cfg0 = config(size, "gpt2", "adamw", 1e-3)
        _, arms = prepare(cfg0.data, Path(tmp), size.vocab_size, size.block_size)
        train_batches = batches(arms, size, size.steps, args.seed, "train")
        held_out = batches(arms, size, size.eval_batches, args.seed + 1, "val")
        pool = (ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_threads,
                                    initargs=(args.threads,)) if args.jobs > 1 else None)
        sweeps = SWEEPS["quick" if args.quick else "full"]
        results: dict[str, dict] = {}
        # the AdamW subjects at once, then Muon's, whose AdamW part (embeddings, head) takes modern+AdamW's best lr
        for phase in (sweeps[:2], sweeps[2:]):
            cfgs = [(name, key, value, config(size, arch, optimizer, value) if key == "lr" else
                     config(size, arch, optimizer, results["modern+AdamW"]["best"]["value"], value))
                    for name, arch, optimizer, key, grid in phase for value in grid]
            curves = sweep(pool, [c[3] for c in cfgs], train_batches, held_out, size.eval_every)
            for (name, key, value, cfg), curve in zip(cfgs, curves):
                print(f"sweep: {name} {key}={value:g}: held-out {curve[-1][1]:.4f}", file=sys.stderr, flush=True)
                run = {"value": value, "curve": curve, "cfg": cfg}
                results.setdefault(name, {"key": key, "runs": []})["runs"].append(run)
            for name in {c[0] for c in cfgs}:
                results[name]["best"] = best(results[name]["runs"])
        if pool is not None:
            pool.shutdown()
        best_cfgs = {n: r["best"]["cfg"] for n, r in results.items()}
        times = time_steps(best_cfgs, train_batches, time_n)
        big_times = (time_steps(*scaled_batch(best_cfgs, train_batches, args.time_batch_scale), time_n)
                     if args.time_batch_scale > 1 else None)
    load_after = os.getloadavg()
    target = results[BASELINE]["best"]["curve"][-1][1]
    base_steps = steps_to_reach(results[BASELINE]["best"]["curve"], target)
    base_time = statistics.median(times[BASELINE])
    summary = []
    for name, r in results.items():
        reach = steps_to_reach(r["best"]["curve"], target)
        q1, med, q3 = quartiles(times[name])
        summary.append({"subject": name, "key": r["key"], "value": r["best"]["value"],
                        "final": r["best"]["curve"][-1][1], "steps_to_target": reach,
                        "step_ratio": reach / base_steps if reach is not None else None,
                        "step_ms": 1000 * med, "step_iqr_ms": (1000 * q1, 1000 * q3), "time_ratio": med / base_time,
                        "big_time_ratio": (statistics.median(big_times[name]) / statistics.median(big_times[BASELINE])
                                           if big_times else None)})
    plot(results, target, Path(args.plot))

    print(f"# bench/recipe.py{' --quick' if args.quick else ''}\n")
    print(f"Shape: {size.n_layer} layers, {size.n_head} heads, n_embd {size.n_embd}, block {size.block_size}, "
          f"vocab {size.vocab_size}; batch {size.batch_size} x {size.block_size} tokens, {size.steps} steps, "
          f"held-out loss every {size.eval_every} steps over {size.eval_batches} batches; {args.threads} torch "
          f"thread(s) per run, {args.jobs} run(s) at once; seed {args.seed}. Wall time "
          f"{time.perf_counter() - started:.0f} s; load average "
          f"{load_before[0]:.1f} before, {load_after[0]:.1f} after.\n")
    print("## Sweep (final held-out loss)\n\n| subject | key | value | final held-out loss |\n|---|---|---|---|")
    for name, r in results.items():
        for run in r["runs"]:
            mark = " (best)" if run is r["best"] else ""
            print(f"| {name} | {r['key']} | {run['value']:g}{mark} | {run['curve'][-1][1]:.4f} |")
    print(f"\n## Result (target: {BASELINE}'s final held-out loss {target:.4f})\n")
    big = f"time ratio at {args.time_batch_scale}x the batch"
    print(f"| subject | best | final held-out loss | steps to target | step ratio | ms per step (IQR) | time ratio | "
          f"{big} |")
    print("|---|---|---|---|---|---|---|---|")
    for s in summary:
        reach = f"{s['steps_to_target']:.0f}" if s["steps_to_target"] is not None else "-"
        ratio = f"{s['step_ratio']:.2f}" if s["step_ratio"] is not None else "-"
        big_ratio = f"{s['big_time_ratio']:.2f}" if s["big_time_ratio"] is not None else "-"
        print(f"| {s['subject']} | {s['key']} {s['value']:g} | {s['final']:.4f} | {reach} | {ratio} | "
              f"{s['step_ms']:.0f} ({s['step_iqr_ms'][0]:.0f}-{s['step_iqr_ms'][1]:.0f}) | {s['time_ratio']:.2f} | "
              f"{big_ratio} |")
    muon = summary[-1]
    step_ok = muon["step_ratio"] is not None and muon["step_ratio"] <= STEP_TARGET
    print(f"\n- modern+Muon steps to {BASELINE}'s final loss: "
          f"{'-' if muon['step_ratio'] is None else format(muon['step_ratio'], '.2f')}x "
          f"(target <= {STEP_TARGET}) -> {'PASS' if step_ok else 'MISS'}")
    print(f"- modern+Muon time per step: {muon['time_ratio']:.2f}x (target <= {TIME_TARGET}) -> "
          f"{'PASS' if muon['time_ratio'] <= TIME_TARGET else 'MISS'}")
    print(f"- plot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "size": vars(size), "threads": args.threads, "load": [load_before[0], load_after[0]],
            "target": target, "summary": summary, "times": times, "big_batch_times": big_times,
            "sweeps": {n: [{"value": run["value"], "curve": run["curve"]} for run in r["runs"]]
                       for n, r in results.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
