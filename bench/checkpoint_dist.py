"""Sharded checkpoint commit: N ZeRO-1 writers into one `step_N.bin` against one writer, on the same bytes.

Spawns N processes (gloo on 127.0.0.1, the groups andrea/control/parallel/distributed.py creates), each holding the same seeded
flat state [w | m | v] of a preset's size (or `--synthetic-params N`). Per round, in turn (the order reversed every
other round, so a drift of the disk within a round cancels), after an untimed warm-up:

    one writer     rank 0 alone, as the one-process CheckpointWriter: snapshot = memcpy of 12·n bytes into its
                   staging image; commit = commit_image (O_DIRECT when the filesystem takes it, +
                   ftruncate + fsync + rename + directory fsync).
    N writers      every rank, as the ShardedCheckpointWriter (andrea/control/commit/shards.py): snapshot = memcpy of its
                   12·n/N bytes of slices into its ShardImage; commit = shards.commit_shards (the tails'
                   exchange; every rank writes its whole blocks of the one .tmp with O_DIRECT, + fsync; rank 0,
                   once every vote is in, renames and sends the verdict): rank 0's wall time from a barrier to its
                   return, which waits for every rank's vote (a trailing barrier would add a collective's latency
                   that the one writer does not pay); stall = the slowest rank's snapshot.
    ..., spare     both again into the run directory's spare (andrea/rundir/spare.py): each commit's file is then
                   released the way retention releases one, and the next commit of that pair overwrites its
                   blocks. Every commit of a run after its first keep_last + 1 is this case.
    ..., buffered  both again with O_DIRECT off (a filesystem that refuses it), the like-for-like pair.
The other pairs write fresh files (the spare pair has a directory of its own). Printed: per method the median
stall and commit seconds, throughput = checkpoint bytes / commit seconds, and the ratios N writers / one writer
(throughput: > 1 is faster; stall: < 1 is shorter), with the quartiles of the per-round ratios. The files are checked
byte-identical across methods (the format knows nothing of world size). Timings describe this machine; nothing
here fails on them. Files go to a fresh temporary directory under `--dir` (default: beside the repository; not
/dev/shm, which would measure RAM), flushed with os.sync() and deleted (the spare pair: released) between
methods, removed at the end.

    python bench/checkpoint_dist.py --preset andrea-12m --writers 2
    python bench/checkpoint_dist.py --synthetic-params 120000000 --writers 4 --repeats 3 --dir /mnt/nvme/tmp
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from andrea.rundir import checkpoint as ckpt, spare  # noqa: E402
from andrea.rundir.checkpoint_write import DirectIO, commit_image
from andrea.control.commit.shard_layout import ShardImage  # noqa: E402
from andrea.control.commit.shards import commit_shards  # noqa: E402
from andrea.control.commit.writer import staging_image  # noqa: E402
from andrea.control.parallel.distributed import World, shard_bounds  # noqa: E402


METHODS = ("one", "one buffered", "one spare", "sharded", "sharded buffered", "sharded spare")


def state(n: int) -> np.ndarray:
    """The same [w | m | v] on every rank (seeded), v >= 0 so the file is a valid checkpoint."""
    flat = np.random.default_rng(0).standard_normal(3 * n, dtype=np.float32)
    np.abs(flat[2 * n:], out=flat[2 * n:])
    return flat


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def median_ci(ratios: list[float], level: float = 0.95, resamples: int = 10_000) -> tuple[float, float]:
    """Percentile-bootstrap interval of the median of per-round ratios (seeded: the same rounds print the same
    interval). A pair whose interval holds 1.0 shows no difference at this many rounds."""
    x = np.asarray(ratios)
    meds = np.median(np.random.default_rng(0).choice(x, (resamples, len(x))), axis=1)
    lo, hi = np.quantile(meds, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def worker(rank: int, size: int, port: int, n: int, repeats: int, out_dir: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    world = World(rank, size, rank)
    world.init(torch.device("cpu"))
    fresh, recycled = Path(out_dir) / "fresh", Path(out_dir) / "spare"
    flat = torch.from_numpy(state(n))
    lo, hi = shard_bounds(n, size, rank)
    mine = (flat[lo:hi], flat[n + lo:n + hi], flat[2 * n + lo:2 * n + hi])
    staging = ShardImage(n, size, rank, pinned=False)
    if world.leader:
        image = staging_image(n, pinned=False)
        full = image[ckpt.HEADER.size:ckpt.HEADER.size + 12 * n].view(torch.float32)
    rows, digests = [], {}
    for rnd in range(repeats + 1):
        row = {}
        for method in METHODS if rnd % 2 == 0 else METHODS[::-1]:  # reversed every other round: drift cancels
            step, run_dir = rnd, recycled if method.endswith("spare") else fresh
            world.barrier()
            if method.startswith("sharded"):
                t0 = time.perf_counter()
                for dst, src in zip(staging.views, mine):
                    dst.copy_(src)
                stall = time.perf_counter() - t0
                world.barrier()
                t1 = time.perf_counter()
                path = commit_shards(world, run_dir, step, n, staging, DirectIO("buffered" not in method))
                commit = time.perf_counter() - t1  # rank 0's: it publishes after every rank's vote
                stall = max(world.gather(stall))
            elif world.leader:
                t0 = time.perf_counter()
                full.copy_(flat)
                stall = time.perf_counter() - t0
                t1 = time.perf_counter()
                path = commit_image(run_dir, step, image.numpy(), n,
                                         direct=DirectIO("buffered" not in method))
                commit = time.perf_counter() - t1
            world.barrier()
            if world.leader:
                digests[method] = digest(path)
                if run_dir == recycled:
                    assert spare.retire(path), "this filesystem keeps no spare (no leases): no spare pair here"
                else:
                    path.unlink()
                os.sync()
                row[method] = (stall, commit)
        if rnd and world.leader:  # round 0 is the warm-up
            rows.append(row)
    if world.leader:
        results.put((rows, digests))
    world.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    size = p.add_mutually_exclusive_group()
    size.add_argument("--preset", help="an andrea preset (default andrea-12m): its parameter count")
    size.add_argument("--synthetic-params", type=int, metavar="N")
    p.add_argument("--writers", type=int, default=2, help="ranks writing one checkpoint (default 2)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds after the warm-up round (default 3)")
    p.add_argument("--dir", help="target directory (default: a temporary directory beside the repository)")
    p.add_argument("--json", metavar="PATH", help="also write every raw timing as JSON")
    args = p.parse_args(argv)
    if args.synthetic_params:
        n, what = args.synthetic_params, f"{args.synthetic_params:,} synthetic parameters"
    else:
        from andrea.config import load as configload
        from andrea.model.gpt import layout_for, n_params
        preset = args.preset or "andrea-12m"
        n, what = n_params(layout_for(configload.load(preset=preset).model)), preset
    nbytes = ckpt.checkpoint_bytes(n)
    out = Path(tempfile.mkdtemp(prefix="andrea-ckdist-", dir=args.dir or REPO))
    (out / "fresh").mkdir()
    (out / "spare").mkdir()
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        results = ctx.SimpleQueue()
        mp.start_processes(worker, args=(args.writers, port, n, args.repeats, str(out), results),
                           nprocs=args.writers, start_method="spawn")
        rows, digests = results.get()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    med = {m: (statistics.median(r[m][0] for r in rows), statistics.median(r[m][1] for r in rows))
           for m in rows[0]}
    print(f"## Sharded checkpoint commit: {what}, {nbytes / 1e6:.1f} MB, {args.writers} writers, "
          f"{args.repeats} rounds, in {args.dir or REPO}\n")
    print("| method | stall s | commit s | throughput GB/s |\n|---|---|---|---|")
    label = {"one": "one writer", "one buffered": "one writer, buffered", "one spare": "one writer, spare",
             "sharded": f"{args.writers} writers", "sharded buffered": f"{args.writers} writers, buffered",
             "sharded spare": f"{args.writers} writers, spare"}
    for m, (stall, commit) in med.items():
        print(f"| {label[m]} | {stall:.4f} | {commit:.3f} | {nbytes / commit / 1e9:.2f} |")
    same = len(set(digests.values())) == 1
    print(f"\nbyte-identical files across methods: {same}")
    for mine, base in (("sharded spare", "one spare"), ("sharded", "one"), ("sharded buffered", "one buffered"),
                       ("one spare", "one")):
        thr = [r[base][1] / r[mine][1] for r in rows]
        stall = statistics.median(r[mine][0] / r[base][0] for r in rows)
        q1, _, q3 = statistics.quantiles(thr, n=4) if len(thr) > 1 else (thr[0],) * 3
        lo, hi = median_ci(thr)
        print(f"{label[mine]} / {label[base]}: throughput x{statistics.median(thr):.3f} (95% CI of the median "
              f"{lo:.3f}-{hi:.3f}; quartiles {q1:.2f}-{q3:.2f}), stall x{stall:.2f} (per-round medians)")
    if args.json:
        Path(args.json).write_text(json.dumps({"n_params": n, "bytes": nbytes, "writers": args.writers,
                                               "rounds": rows, "identical": same}, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
