"""ZeRO-1 step anatomy: how much of a data-parallel step is communication, with one collective after the backward.

andrea/control/parallel/zero.py communicates after the backward, not in bucketed hooks during it (why: its docstring). This
measures what that choice costs: N spawned ranks (gloo on CPU, NCCL on CUDA; the groups andrea/control/parallel/distributed.py
creates) run ZeroTrainer.train_step on random tokens of the preset's global batch; the collectives it calls
(distributed.reduce_scatter_mean, all_reduce_sum, all_gather) are timed by wrapping them (on CUDA with a
synchronize on each side, so the step is serialised as it already is: every collective follows the backward on the
compute stream). Printed per world size: median step seconds, median seconds inside collectives and their share of
the step — the most that overlapping buckets with the backward could hide — and the one-process step on the same
global batch for scale. Timings describe this machine; nothing here fails on them.

    python bench/zero_dist.py --preset andrea-tiny --ranks 2
    python bench/zero_dist.py --preset andrea-12m --ranks 2 --steps 5 --batch-size 4
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from andrea.config import load as configload  # noqa: E402
from andrea.control.parallel import distributed as dist_  # noqa: E402
from andrea.control.parallel.distributed import World  # noqa: E402
from andrea.control.run.trainer import Trainer, resolve_device  # noqa: E402
from andrea.control.parallel.zero import ZeroTrainer  # noqa: E402


def batches(cfg, steps: int):
    gen = torch.Generator().manual_seed(0)
    shape = (cfg.train.batch_size, cfg.model.block_size)
    return [(torch.randint(0, cfg.model.vocab_size, shape, generator=gen),
             torch.randint(0, cfg.model.vocab_size, shape, generator=gen)) for _ in range(steps)]


def timed_steps(trainer, data, device, spent: list[float]) -> list[float]:
    out = []
    for i, (x, y) in enumerate(data):
        spent.clear()
        sync(device)
        t0 = time.perf_counter()
        trainer.train_step(i, x, y).loss.item()
        sync(device)
        out.append((time.perf_counter() - t0, sum(spent)))
    return out[1:]  # the first step pays for allocation and warm-up


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(rank: int, size: int, port: int, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    cfg = configload.load(preset=args.preset, overrides=[f"train.batch_size={args.batch_size}"] if args.batch_size
                      else [])
    world = World(rank, size, rank)
    device = world.device(resolve_device(args.device))
    world.init(device)
    spent: list[float] = []
    for name in ("reduce_scatter_mean", "all_reduce_sum", "all_gather"):
        fn = getattr(dist_, name)

        def wrapped(*a, _fn=fn):
            sync(device)
            t0 = time.perf_counter()
            _fn(*a)
            sync(device)
            spent.append(time.perf_counter() - t0)
        setattr(dist_, name, wrapped)
    trainer = ZeroTrainer(cfg, device, "torch" if device.type == "cpu" else "triton", world)
    rows = timed_steps(trainer, batches(cfg, args.steps + 1), device, spent)
    results.put((rank, rows))
    world.barrier()  # no rank tears its group down while a peer's gloo threads still talk to it (a SIGABRT, seen once)
    world.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="andrea-tiny")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=10, help="timed steps after one warm-up step (default 10)")
    p.add_argument("--batch-size", type=int, help="global batch (default: the preset's)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--device", default="auto")
    args = p.parse_args()
    cfg = configload.load(preset=args.preset, overrides=[f"train.batch_size={args.batch_size}"] if args.batch_size
                      else [])
    device = resolve_device(args.device)
    torch.set_num_threads(args.threads)
    one = Trainer(cfg, device, "torch" if device.type == "cpu" else "triton")
    single = statistics.median(t for t, _ in timed_steps(one, batches(cfg, args.steps + 1), device, []))
    del one
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(worker, args=(args.ranks, port, args, results), nprocs=args.ranks, start_method="spawn")
    per_rank = dict(results.get() for _ in range(args.ranks))
    # A step ends when the slowest rank's does: per step, the max over ranks.
    steps = [max(per_rank[r][i][0] for r in per_rank) for i in range(args.steps)]
    comm = [max(per_rank[r][i][1] for r in per_rank) for i in range(args.steps)]
    step, spent = statistics.median(steps), statistics.median(comm)
    print(f"## ZeRO-1 step anatomy: {args.preset}, global batch {cfg.train.batch_size}, {args.ranks} ranks "
          f"({'NCCL' if device.type == 'cuda' else 'gloo'}), {args.steps} steps\n")
    print("| | step s | in collectives s | share |\n|---|---|---|---|")
    print(f"| 1 process | {single:.4f} | - | - |")
    print(f"| {args.ranks} ranks | {step:.4f} | {spent:.4f} | {100 * spent / step:.1f} % |")
    print(f"\nOne collective after the backward: bucketed overlap could hide at most {spent * 1e3:.1f} ms "
          f"({100 * spent / step:.1f} % of the step); {args.ranks}-rank step / 1-process step = {step / single:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
