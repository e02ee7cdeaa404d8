"""Gradient clipping for NorMuon, decided by measurement (issue 54): does `train.grad_clip` bind, and what does it buy?

bench/recipe.py's setup, by import (its shape, batches, held-out windows, warmup, cosine), its best row: modern +
NorMuon, muon_lr 0.06, AdamW groups at lr 8e-3. One run per clip value (0 = off, nanochat's choice); for each, the
held-out loss at the last step and the pre-clip gradient norm over the run (median, 90th percentile, max, the max
after the first 50 steps, and the steps a clip at 1.0 and at 0.5 would have cut).

    python bench/clip.py --jobs 2                 # grad_clip 0, 1.0, 0.5 at 300 steps (~3.5 CPU-min a run)
    python bench/clip.py --quick                  # smoke: recipe.py's tiny shape, 12 steps (seconds)

Reads the embedded arms; writes the markdown table to stdout. Losses are a pure function of the seed on one machine.
"""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from recipe import FULL, QUICK, SUBJECTS, config, tokens  # noqa: E402

from andrea.control.run.trainer import Trainer  # noqa: E402

SUBJECT, MUON_LR = "modern+NorMuon", 0.06  # recipe.py's best row (docs/benchmarks.md)


def run(job) -> dict:
    clip, cfg, train_batches, held_out, steps = job
    torch.set_num_threads(1)
    trainer = Trainer(cfg, torch.device("cpu"), kernels="torch")
    norms = [float(trainer.train_step(step, *train_batches[step]).grad_norm) for step in range(steps)]
    final = sum(float(trainer.loss_of(x, y)) for x, y in held_out) / len(held_out)
    return {"clip": clip, "final": final, "norms": norms}


def row(r: dict) -> str:
    n = np.array(r["norms"])  # (steps,) pre-clip global gradient norms
    late = n[50:] if len(n) > 50 else n
    return (f"| {r['clip']:g} | {r['final']:.3f} | {np.median(n):.3f} | {np.percentile(n, 90):.3f} | {n.max():.3f} | "
            f"{late.max():.3f} | {int((n > 1.0).sum())} | {int((n > 0.5).sum())} of {len(n)} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="recipe.py's tiny shape, 12 steps")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (one thread each)")
    parser.add_argument("--clips", default="0,1.0,0.5", help="train.grad_clip values, comma-separated (0: off)")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    arch, fixed, key, _, _ = SUBJECTS[SUBJECT]
    train_batches, held_out = tokens(size)  # recipe.py's, the same bytes
    clips = [float(c) for c in args.clips.split(",")]
    jobs = [(c, config(size, arch, {**fixed, "grad_clip": c}, key, MUON_LR), train_batches, held_out, size.steps)
            for c in clips]
    with ProcessPoolExecutor(args.jobs) as pool:
        results = list(pool.map(run, jobs))
    print(f"| grad_clip | held-out loss at step {size.steps} | norm median | p90 | max | max after step 50 | "
          f"steps > 1.0 | steps > 0.5 |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
