"""Healthy runs' (step, loss, grad_norm) series, for the divergence guard's false-alarm check (issue 46, 47 case 5).

Trains seeds of a preset in process — control/run/trainer.py's Trainer fed by control/mixture/proxy.py's DataProxy, the same
batches and updates a real run takes, without the runtime (no checkpoints, no ledger) — and records every step's
loss and pre-clip gradient norm. Then replays the guard's pure decisions (control/guard/decisions.py) over each series
and prints a table: per seed the incidents, the anomalous steps, the steps at which the commit gate was shut (a
checkpoint due there would be held back) and the first incident's reason. Exit 1 when any seed has an incident.

    python bench/guard_series.py --preset andrea-tiny --seeds 0-9 --steps 500
    python bench/guard_series.py --preset andrea-12m --seeds 0-1 --steps 60 --json series.json

Writes a temporary run directory for the prepared data (or --data DIR, reused) and, with --json, the series:
{"preset", "steps", "batch_size", "seeds": {"7": [[step, loss, grad_norm], ...]}}.
tests/unit/control/guard/healthy_series.json holds its recording of ten andrea-tiny seeds (training them takes minutes);
andrea-12m is a minute a step on two busy cores: record it with --device cuda.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from andrea.config.load import load  # noqa: E402
from andrea.config.schema import RunConfig  # noqa: E402
from andrea.data import store  # noqa: E402
from andrea.control.guard.decisions import INCIDENT, Guard  # noqa: E402
from andrea.control.mixture.proxy import DataProxy  # noqa: E402
from andrea.control.run.trainer import Trainer  # noqa: E402


def series(cfg: RunConfig, arms, steps: int, device: str = "cpu") -> list[tuple[int, float, float]]:
    """Steps 1..`steps` of a fresh run of `cfg` on `device` (torch kernels): [(header step, loss, grad norm)]."""
    trainer = Trainer(cfg, torch.device(device))
    proxy = DataProxy(cfg, arms)
    out = []
    for t in range(steps):
        batch = proxy.batch(t)
        r = trainer.train_step(t, batch.x, batch.y)
        proxy.observe(r.step, r.seq_losses.detach().double().cpu().numpy())
        out.append((r.step, float(r.loss), float(r.grad_norm)))
    return out


def replay(cfg: RunConfig, records, warmup_steps: int | None = None) -> dict:
    """The guard's verdicts over one series: incidents, anomalous steps, the steps at which its commit gate was
    shut (a checkpoint due there would be held back), the first incident's reason."""
    guard = Guard(cfg.guard, warmup_steps=cfg.train.warmup_steps if warmup_steps is None else warmup_steps)
    anomalous, shut, incidents, reason = [], [], 0, None
    for step, loss, grad in records:
        verdict = guard.observe(step, loss, grad)
        if guard.detector.flags and guard.detector.flags[-1]:
            anomalous.append(step)
        if not guard.may_commit():
            shut.append(step)
        if verdict == INCIDENT:
            incidents += 1
            reason = reason or f"step {step}: {guard.pending['reason']}"
            guard.pending = None  # count on: the records stay those of the healthy run
    return {"incidents": incidents, "anomalous": anomalous, "shut": shut, "first": reason}


def seed_list(text: str) -> list[int]:
    """"7", "0-9" or "7,9"."""
    seeds = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        seeds += range(int(lo), int(hi or lo) + 1)
    return seeds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="andrea-tiny")
    ap.add_argument("--seeds", default="0-9", help="a seed, a range or a list: 7, 0-9, 7,9")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--data", help="a run directory holding prepared data for the preset (made if missing)")
    ap.add_argument("--max-bytes", type=int, help="data.max_bytes_per_arm (a faster preparation)")
    ap.add_argument("--set", action="append", default=[], help="section.key=value, as train --set")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (andrea-12m: ~1 min a step on 2 busy cores)")
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sets = list(args.set) + ([f"data.max_bytes_per_arm={args.max_bytes}"] if args.max_bytes else [])
    data_dir = Path(args.data) if args.data else Path(tempfile.mkdtemp(prefix="andrea-series-"))
    recorded: dict[str, list] = {}
    print("| preset | seed | steps | incidents | anomalous steps | gate shut at | first incident | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    total = 0
    for seed in seed_list(args.seeds):
        cfg = load(preset=args.preset, overrides=sets + [f"train.seed={seed}"])
        _, arms = store.prepare(cfg.data, data_dir, cfg.model.vocab_size, cfg.model.block_size)
        t0 = time.monotonic()
        records = series(cfg, arms, args.steps, args.device)
        seconds = time.monotonic() - t0
        recorded[str(seed)] = [[s, round(loss, 6), round(grad, 6)] for s, loss, grad in records]
        r = replay(cfg, records)
        total += r["incidents"]
        print(f"| {args.preset} | {seed} | {args.steps} | {r['incidents']} | {r['anomalous'] or '-'} | "
              f"{r['shut'] or '-'} | {r['first'] or '-'} | {seconds:.0f} |", flush=True)
    print(f"\nincidents across seeds: {total}")
    if args.json:
        cfg = load(preset=args.preset, overrides=sets)
        Path(args.json).write_text(json.dumps({"preset": args.preset, "steps": args.steps, "sets": sets,
                                               "batch_size": cfg.train.batch_size, "seeds": recorded}))
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
