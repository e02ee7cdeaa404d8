"""A run without a fixed end, finished at any step (issue 54): WSD anneal branches against cosine runs planned for
exactly those lengths, and what a tail average of checkpoints gives without an anneal.

bench/recipe.py's setup, by import (its shape, batches, held-out windows, warmup and configurations), its best
optimizer: modern + NorMuon, muon_lr 0.06, AdamW groups at lr 8e-3. Three points P (120, 240 and 300 steps): one
wsd run with its lr held (lr_decay_steps far ahead), `andrea branch --anneal`'s schedule from step P − N over
N = 20 % of P (andrea/optim/schedule.py `anneal`; the branch at 240 is the run's own warmdown to 300, a wsd run
planned for 300), against a cosine run planned for P (warmup, cosine to lr/10 at P); and the mean of the plateau's
last K checkpoints (one every `--every` steps) at P, andrea/model/export.py `average_weights` (`export --average
K`), with no anneal. Held-out loss of each at P; the plateau's own loss beside them.

    python bench/anytime.py --jobs 2      # 4 runs: the plateau and its 3 anneals (432 steps), cosines 120, 240, 300
    python bench/anytime.py --quick       # smoke: recipe.py's tiny shape, 12 steps (seconds)
    python bench/anytime.py --shape 1-sqrt --no-cosine   # the anneals' other shape, the wsd runs alone

Reads the embedded arms; writes the markdown table to stdout. Losses are a pure function of the seed on one machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from recipe import FULL, NORMUON, QUICK, Size, config, tokens  # noqa: E402

from andrea.config.load import load  # noqa: E402
from andrea.control.run.trainer import Trainer  # noqa: E402
from andrea.model.export import average_weights  # noqa: E402
from andrea.optim.schedule import anneal  # noqa: E402

BEST = ("modern", {**NORMUON, "lr": 8e-3}, "muon_lr", 0.06)  # bench/recipe.py's best row
WARMDOWN = 0.2  # of each point's length (Hägele et al. 2024: parity with a cosine at 20 %)


def points(size: Size) -> list[int]:
    return [round(0.4 * size.steps), round(0.8 * size.steps), size.steps]


def warmdown(p: int, fraction: float = WARMDOWN) -> int:
    return max(1, round(fraction * p))


def cosine(size: Size, p: int):
    """A cosine run planned for p steps: recipe.py's, its horizon at p."""
    return config(dataclasses.replace(size, steps=p), *BEST)


def plateau(size: Size, shape: str = "linear"):
    """The wsd run without a fixed end: lr held after the warmup until far past the bench."""
    cfg = config(size, BEST[0], {**BEST[1], "schedule": "wsd", "warmdown_shape": shape}, *BEST[2:])
    return load(base=cfg.to_dict(), overrides=["train.lr_decay_steps=1000000", "train.warmdown_steps=1"])


def held_out_loss(trainer: Trainer, held_out) -> float:
    return sum(float(trainer.loss_of(x, y)) for x, y in held_out) / len(held_out)


def run_cosine(job) -> dict:
    size, p, train_batches, held_out = job
    torch.set_num_threads(1)
    t0, trainer = time.perf_counter(), Trainer(cosine(size, p), torch.device("cpu"), kernels="torch")
    for step in range(p):
        trainer.train_step(step, *train_batches[step])
    loss = held_out_loss(trainer, held_out)
    print(f"cosine planned for {p}: {loss:.3f} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return {"cosine": {p: loss}}


def run_wsd(job) -> dict:
    """The plateau to the last point, its states at each anneal's start and its weights every `every` steps;
    then each anneal from its start, and each point's tail average."""
    size, every, k, shape, fraction, train_batches, held_out = job
    torch.set_num_threads(1)
    t0, cfg = time.perf_counter(), plateau(size, shape)
    trainer = Trainer(cfg, torch.device("cpu"), kernels="torch")
    starts = {p - warmdown(p, fraction): p for p in points(size)}
    states, kept, out = {}, {}, {"plateau": {}, "anneal": {}, "average": {}}
    for step in range(size.steps + 1):
        if step in starts:
            states[step] = trainer.state.buffer.clone()
        if step % every == 0:
            kept[step] = trainer.weights().numpy().copy()
        if step in points(size):
            out["plateau"][step] = held_out_loss(trainer, held_out)
        if step < size.steps:
            trainer.train_step(step, *train_batches[step])
    n = trainer.n
    for p in points(size):
        tail = [kept[s] for s in range(p - (k - 1) * every, p + 1, every)]
        trainer.state.w.copy_(torch.from_numpy(average_weights(tail, n)))
        out["average"][p] = held_out_loss(trainer, held_out)
    for start, p in starts.items():
        branch = load(base=cfg.to_dict(), overrides=anneal(start, p - start, cfg.train))  # `branch --anneal`'s keys
        annealed = Trainer(branch, torch.device("cpu"), kernels="torch")
        annealed.load(states[start])
        for step in range(start, p):
            annealed.train_step(step, *train_batches[step])
        out["anneal"][p] = held_out_loss(annealed, held_out)
    print(f"wsd plateau and anneals: {out} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="recipe.py's tiny shape, 12 steps")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (one thread each)")
    parser.add_argument("--every", type=int, help="the plateau's checkpoint cadence (default 10; quick 1)")
    parser.add_argument("-k", type=int, default=5, help="checkpoints in the tail average (default 5)")
    parser.add_argument("--shape", default="linear", choices=["linear", "1-sqrt"], help="the anneals' warmdown_shape")
    parser.add_argument("--warmdown", type=float, default=WARMDOWN, help="each anneal's share of its point (0.2)")
    parser.add_argument("--cosine", action=argparse.BooleanOptionalAction, default=True,
                        help="also the cosine runs (--no-cosine: the wsd runs alone)")
    args = parser.parse_args()
    size = QUICK if args.quick else FULL
    every = args.every or (1 if args.quick else 10)
    if any(p - (args.k - 1) * every < 0 or p % every for p in points(size)):
        parser.error(f"-k {args.k} --every {every}: each point {points(size)} needs k checkpoints ending at it")
    train_batches, held_out = tokens(size)  # recipe.py's, the same bytes
    results: dict[str, dict[int, float]] = {"cosine": {}}
    with ProcessPoolExecutor(args.jobs) as pool:  # longest first: the wsd runs, then the cosines by length
        futures = [pool.submit(run_wsd, (size, every, args.k, args.shape, args.warmdown, train_batches, held_out))]
        futures += [pool.submit(run_cosine, (size, p, train_batches, held_out)) for p in reversed(points(size))
                    if args.cosine]
        for f in futures:
            for kind, losses in f.result().items():
                results.setdefault(kind, {}).update(losses)
    print(f"| point (steps) | wsd + anneal (last {round(100 * args.warmdown)} %, {args.shape}) | cosine planned for it | "
          f"average of the last {args.k} checkpoints (every {every}), no anneal | the plateau, no anneal |")
    print("|---|---|---|---|---|")
    for p in points(size):
        planned = f"{results['cosine'][p]:.3f}" if p in results["cosine"] else "-"
        print(f"| {p} (anneal from {p - warmdown(p, args.warmdown)}) | {results['anneal'][p]:.3f} | {planned} | "
              f"{results['average'][p]:.3f} | {results['plateau'][p]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
