"""The data bandit against fixed mixtures, on the held-out target loss (`policy.target`; the bandit:
docs/formats.md#the-data-proxy-and-its-bandit).

For every seed and arm set it trains the same model three ways, the data proxy (andrea/control/mixture/proxy.py) choosing
each batch exactly as `andrea train` does (same lag, same allocation, same per-sequence losses fed back):
- default: the bandit with the configuration's own knobs;
- uniform: floors 1/K on every arm (the bandit pinned to the uniform mixture);
- fixed: floors set to the target's weights (the mixture a user would write by hand for that objective;
  skipped where it is uniform, as for the built-in arms' default target).
Arm sets: the built-in arms, and the built-in arms plus `noise` (random letters: unlearnable) with target weight 0.
The target loss (Σ target_i · held-out loss_i / Σ target_i, andrea/evals/audit.py) is measured every `train.eval_every`
steps with the same held-out windows as the `eval` markers. Printed: mean ± sd over seeds of the final target
loss, its ratio to uniform, the final share of each arm, and the first eval step at which each policy reaches
uniform's final target loss (mean over seeds of that step / uniform's steps; "-" when a seed never does).
In-process (no control plane): the run's data is prepared once per arm set into a temporary directory.

    python bench/mixture.py                    # andrea-tiny, 600 steps, seeds 1-3 (~10 min on 2 CPU cores)
    python bench/mixture.py --quick            # smoke: 60 steps, one seed
    python bench/mixture.py --preset andrea-12m --steps 300 --batch-size 8 --max-bytes 2000000 --device cuda
    python bench/mixture.py --json out.json    # also every eval of every run

Reads the presets and the embedded arms; writes a temporary directory (removed) and a markdown report to stdout.
Timings are not measured: only losses and mixtures, which on one machine are a pure function of the seed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from andrea.evals.audit import evaluate, target_loss  # noqa: E402
from andrea.config.schema import RunConfig  # noqa: E402
from andrea.config.load import load  # noqa: E402
from andrea.control.mixture.proxy import DataProxy  # noqa: E402
from andrea.data.store import prepare  # noqa: E402
from andrea.control.run.trainer import Trainer, resolve_device  # noqa: E402

NOISE_ARM = "noise"


def write_noise(path: Path, n_bytes: int, seed: int = 0) -> None:
    """Random lowercase letters in 64-letter lines: nothing to learn past the letter frequencies."""
    rng = np.random.default_rng(seed)
    letters = rng.integers(ord("a"), ord("z") + 1, size=n_bytes, dtype=np.uint8)
    letters[63::64] = ord("\n")
    path.write_bytes(letters.tobytes())


def base_overrides(args: argparse.Namespace, noise_path: Path | None) -> dict:
    raw: dict = {"train": {"steps": args.steps}, "data": {"max_bytes_per_arm": args.max_bytes}}
    if args.batch_size:
        raw["train"]["batch_size"] = args.batch_size
    if args.eval_every:
        raw["train"]["eval_every"] = args.eval_every
    if noise_path is not None:
        raw["data"]["sources"] = [{"name": NOISE_ARM, "path": str(noise_path), "max_bytes": args.max_bytes}]
        raw["policy"] = {"target": {NOISE_ARM: 0.0}}
    return raw


def policy_for(kind: str, cfg: RunConfig) -> dict:
    """The `[policy]` table of each compared policy (over the configured target)."""
    names = cfg.data.arm_names()
    if kind == "default":
        return {}
    if kind == "uniform":
        return {"floors": {a: 1.0 / len(names) for a in names}, "caps": {}}
    target = cfg.policy.target_weights(names)
    return {"floors": dict(zip(names, target)), "caps": {}}


def train_one(cfg: RunConfig, arms, device: torch.device) -> list[dict]:
    """Train cfg.train.steps steps; one record per eval: {"step", "target_loss", "arms", "shares"}."""
    trainer = Trainer(cfg, device)
    proxy = DataProxy(cfg, arms)
    weights = cfg.policy.target_weights(proxy.names)
    evals = []
    for step in range(cfg.train.steps):
        batch = proxy.batch(step)
        out = trainer.train_step(step, batch.x, batch.y)
        proxy.observe(step + 1, out.seq_losses.detach().double().cpu().numpy())
        if (step + 1) % cfg.train.eval_every == 0 or step + 1 == cfg.train.steps:
            losses = evaluate(trainer, arms, cfg)
            evals.append({"step": step + 1, "target_loss": target_loss(losses, dict(zip(proxy.names, weights))),
                          "arms": losses, "shares": proxy.shares()})
    return evals


def steps_to_reach(evals: list[dict], level: float) -> int | None:
    return next((e["step"] for e in evals if e["target_loss"] <= level), None)


def fmt(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.4f} ± {statistics.stdev(xs):.4f}" if len(xs) > 1 else f"{xs[0]:.4f}"


def report(title: str, results: dict[str, list[list[dict]]], names: list[str]) -> None:
    uniform_final = [runs[-1]["target_loss"] for runs in results["uniform"]]
    print(f"\n### {title}\n")
    print("| policy | final target loss | vs uniform | steps to uniform's final (x uniform's) | final shares |")
    print("|---|---|---|---|---|")
    for kind, runs in results.items():
        final = [r[-1]["target_loss"] for r in runs]
        ratio = statistics.mean(f / u for f, u in zip(final, uniform_final))
        reach = [steps_to_reach(r, u) for r, u in zip(runs, uniform_final)]
        reach_txt = ("-" if None in reach else
                     f"{statistics.mean(s / r[-1]['step'] for s, r in zip(reach, runs)):.2f} ({reach})")
        shares = {a: statistics.mean(r[-1]["shares"][a] for r in runs) for a in names}
        print(f"| {kind} | {fmt(final)} | {ratio:.4f} | {reach_txt} | "
              + ", ".join(f"{a} {s:.2f}" for a, s in shares.items()) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="andrea-tiny")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--batch-size", type=int, default=0, help="0: the preset's")
    ap.add_argument("--eval-every", type=int, default=0, help="0: the preset's")
    ap.add_argument("--max-bytes", type=int, default=300_000, help="text per arm (data.max_bytes_per_arm)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--policies", nargs="+", default=["default", "uniform", "fixed"])
    ap.add_argument("--sets", nargs="+", default=["builtin", "noise"], choices=["builtin", "noise"])
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value, every run")
    ap.add_argument("--quick", action="store_true", help="smoke test: 60 steps, seed 1, eval every 20")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.seeds, args.eval_every, args.max_bytes = 60, [1], 20, 60_000
    if "uniform" not in args.policies:
        args.policies.append("uniform")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    device = resolve_device(args.device)
    print(f"## Data mixture: {args.preset}, {args.steps} steps, seeds {args.seeds}, device {device}")
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="andrea-mixture-") as tmp:
        for arm_set in args.sets:
            run_dir = Path(tmp) / arm_set
            run_dir.mkdir()
            noise = None
            if arm_set == "noise":
                noise = run_dir / "noise.txt"
                write_noise(noise, args.max_bytes)
            base = base_overrides(args, noise)
            cfg0 = load(args.preset, base=base, overrides=args.overrides, base_source="bench")
            codec, arms = prepare(cfg0.data, run_dir, cfg0.model.vocab_size, cfg0.model.block_size)
            results: dict[str, list[list[dict]]] = {}
            for kind in args.policies:
                if kind == "fixed" and policy_for(kind, cfg0) == policy_for("uniform", cfg0):
                    continue  # the target's own mixture is uniform here: the same runs again
                for seed in args.seeds:
                    layer = {**base, "policy": {**base.get("policy", {}), **policy_for(kind, cfg0)},
                             "train": {**base["train"], "seed": seed}}
                    cfg = load(args.preset, base=layer, overrides=args.overrides, base_source="bench")
                    evals = train_one(cfg, arms, device)
                    results.setdefault(kind, []).append(evals)
                    print(f"  {arm_set} {kind} seed {seed}: target loss {evals[-1]['target_loss']:.4f}",
                          file=sys.stderr, flush=True)
            title = ("built-in arms, equal target" if arm_set == "builtin"
                     else f"built-in arms + `{NOISE_ARM}` (random letters), target weight 0 on {NOISE_ARM}")
            report(title, results, cfg0.data.arm_names())
            out[arm_set] = results
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
