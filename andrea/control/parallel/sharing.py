"""Whether the ranks of a data-parallel run share one run directory, and what rank 0 hands the ranks that do not.

Writes and removes `RUN_DIR/.share-probe.<nonce>` (one per rank, for the moment of the probe at start); reads,
on rank 0 for every rank when the directory is not shared, checkpoints (rundir/checkpoint.py) and sidecars.

Under torchrun the same `--run-dir` path may name one directory on a filesystem every node mounts, or a
directory on each node's own disk (two rented machines). The sharded commit (control/commit/shards.py) needs the
first: every rank writes its blocks into the one `.tmp`. So at start every rank writes a probe file named by a
fresh nonce of its own (os.urandom: not training randomness), the nonces are all-gathered, and every rank
reads every probe back from its own view of the run directory; the answers, gathered, are the `seen` matrix
that `decide` (pure) turns into `RunDirSharing`. Fresh names, never looked up before, keep a network filesystem's
negative lookup cache out of the answer; close-to-open consistency makes a closed file's bytes visible.

    shared      every rank saw every probe: one directory. Everything stays as it was: the sharded commit,
                every rank reading checkpoints and sidecars itself.
    separate    otherwise. Rank 0's directory holds the run. Checkpoints: rank 0 gathers the slices and writes
                alone (control/commit/gathered.py); the other ranks write nothing into their directories. Reads of
                the run (the checkpoint resumed from or rolled back to, its sidecars, the configuration, a
                pivot's policy) happen on rank 0, which sends the others what they need (`from_leader`,
                `payload_everywhere`). Each group of ranks that sees one directory (`view`: its lowest rank)
                prepares its own copy of the data (control/parallel/ranks.py), deterministically.
A matrix that is not an equivalence (a rank that does not see its own probe, or one that sees a probe whose
writer does not see its own) is a filesystem no run can trust: one clear error on every rank.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

from andrea.control.parallel.distributed import World
from andrea.rundir import names, sidecars

log = logging.getLogger("andrea.sharing")
T = TypeVar("T")


@dataclass(frozen=True)
class RunDirSharing:
    """What the probe found: whether the ranks share one run directory, and which directory each rank sees."""

    shared: bool  # every rank sees every probe: one run directory
    view: tuple[int, ...]  # per rank: the lowest rank seeing the same directory (0 for rank 0's)
    problem: str | None = None  # why the answers describe no filesystem a run can trust


def decide(seen: list[list[bool]]) -> RunDirSharing:
    """seen[r][s]: rank r read back rank s's probe. Pure: the gathered answers -> the views of the ranks."""
    size = len(seen)
    for r, row in enumerate(seen):
        if not row[r]:
            return RunDirSharing(False, tuple(range(size)), f"rank {r} cannot read back its own probe file in the run "
                                                    "directory")
        for s in range(size):
            if row[s] != seen[s][r]:
                a, b = (r, s) if row[s] else (s, r)
                return RunDirSharing(False, tuple(range(size)), f"rank {a} sees rank {b}'s probe file but rank {b} does "
                                                        f"not see rank {a}'s (a filesystem whose nodes disagree)")
    view = tuple(min(s for s in range(size) if seen[r][s]) for r in range(size))
    for r in range(size):  # an equivalence: whoever r sees, sees exactly what r sees
        if any(seen[r][s] and seen[s] != seen[r] for s in range(size)):
            return RunDirSharing(False, view, f"rank {r}'s run directory is seen by ranks that see different "
                                      "directories (a filesystem whose nodes disagree)")
    return RunDirSharing(all(all(row) for row in seen), view)


def probe_path(run_dir: Path, nonce: str) -> Path:
    return run_dir / f"{names.PROBE_PREFIX}{nonce}"


def read_probe(path: Path, nonce: str) -> bool:
    try:
        return path.read_text() == nonce
    except OSError:  # absent (another disk), or unreadable: not the same directory
        return False


def probe(world: World, run_dir: Path) -> RunDirSharing:
    """Every rank together, at start (control group): find out, record it on `world`, say it once."""
    if not world.distributed:
        return RunDirSharing(True, (0,))
    mine = os.urandom(16).hex()
    nonces = world.gather(mine)
    own = probe_path(run_dir, mine)
    own.write_text(mine)
    world.barrier()  # every probe is written and closed before any is read
    seen = world.gather([read_probe(probe_path(run_dir, n), n) for n in nonces])
    own.unlink(missing_ok=True)  # every rank has read (its answer is in the gather)
    views = decide(seen)
    if views.problem is not None:
        raise OSError(f"{run_dir}: {views.problem}")
    world.shared_dir, world.view = views.shared, views.view[world.rank]
    if world.view == world.rank:  # one rank per directory: a probe a crash left behind (none of this start's)
        for stale in run_dir.glob(f"{names.PROBE_PREFIX}*"):
            stale.unlink(missing_ok=True)
    if not views.shared and world.leader:
        groups = sorted({v for v in views.view})
        log.warning("%s is not one directory for all ranks (%d separate disks, first ranks %s): rank 0's holds "
                    "the run and writes every checkpoint alone, after gathering the other ranks' %.0f%% of the "
                    "optimizer state; the other ranks write nothing there", run_dir, len(groups), groups,
                    100 * (world.size - 1) / world.size)
    elif not views.shared and world.view == world.rank:
        log.warning("%s on this node is not rank 0's: nothing here is read or written but the data rank %d "
                    "prepares; the run lives in rank 0's directory", run_dir, world.rank)
    return views


# --- what rank 0 reads for every rank ---------------------------------------------------------------------------
def from_leader(world: World, fn: Callable[..., T], *args) -> T:
    """fn(*args) as rank 0's view of the run directory answers it, on every rank (an exception it raises is
    raised on every rank). A shared directory: every rank calls fn itself, as before."""
    if world.shared_dir or not world.distributed:
        return fn(*args)
    return leader_decides(world, fn, *args)


def leader_decides(world: World, fn: Callable[..., T], *args) -> T:
    """fn(*args) run by rank 0 alone (it may write: a quarantine), its value on every rank, and an exception it
    raises raised on every rank: the refusal's one line on each, never the others waiting in the broadcast until rank
    0's exit breaks it into a traceback (campaign seed 214: every checkpoint of a 2-rank run damaged)."""
    if not world.distributed:
        return fn(*args)
    outcome: tuple = (None, None)
    if world.leader:
        try:
            outcome = (fn(*args), None)
        except Exception as e:  # noqa: BLE001 - every rank must raise it, or the others wait forever
            outcome = (None, e)
    value, error = world.broadcast(outcome)
    if error is not None:
        raise error
    return value


def leader_only(world: World, fn: Callable[..., T], *args) -> T | None:
    """fn(*args) run by rank 0 alone, its value kept there (None on the other ranks: nothing is sent), and an
    exception it raises raised on every rank. For a check only rank 0 makes at the start (the ledger against the
    checkpoint, --init-from's tokenizer, the task audit's file): its refusal is every rank's one line, never rank 1
    training on into a collective that rank 0's exit breaks into a traceback (campaign seed 483)."""
    kept = None

    def run() -> None:
        nonlocal kept
        kept = fn(*args)
    leader_decides(world, run)
    return kept


def json_reader(world: World) -> Callable[[Path], object]:
    """sidecars.read_json as rank 0's view of the run directory answers it (`from_leader`)."""
    return lambda path: from_leader(world, sidecars.read_json, path)


def share_payload(world: World, payload: torch.Tensor | BaseException | None, n: int) -> torch.Tensor:
    """Rank 0's [w | m | v] (3n,) fp32 -> on every rank a (3n,) tensor holding all of w and this rank's m and v
    slices (ZeRO-1's bounds; zeros elsewhere), which is what ZeroTrainer.load reads. An exception on rank 0
    (`payload` is one) is raised on every rank. Moves 4n bytes to each rank (w), 8·(hi - lo) to rank r."""
    error = world.broadcast(payload if isinstance(payload, BaseException) else None)
    if error is not None:
        raise error
    out = payload.contiguous() if world.leader else torch.zeros(3 * n, dtype=torch.float32)
    world.broadcast_tensor(out[:n])
    if world.leader:
        for r in range(1, world.size):
            lo, hi = world.shard_bounds(n, r)
            if hi > lo:
                world.send(out[n + lo:n + hi], r, "control")
                world.send(out[2 * n + lo:2 * n + hi], r, "control")
    else:
        lo, hi = world.shard_bounds(n)
        if hi > lo:
            world.recv(out[n + lo:n + hi], 0, "control")
            world.recv(out[2 * n + lo:2 * n + hi], 0, "control")
    return out


async def payload_everywhere(world: World, read: Callable[[], torch.Tensor | np.ndarray], n: int,
                             executor: Executor) -> torch.Tensor:
    """[w | m | v] for this rank's trainer.load: `read()` (on `executor`) on every rank of a shared directory,
    on rank 0 alone otherwise, its result sent from there (the event loop's control group)."""
    loop = asyncio.get_running_loop()

    def tensor() -> torch.Tensor:
        got = read()
        return got if isinstance(got, torch.Tensor) else torch.from_numpy(got)

    if world.shared_dir or not world.distributed:
        return await loop.run_in_executor(executor, tensor)
    got: torch.Tensor | BaseException | None = None
    if world.leader:
        try:
            got = await loop.run_in_executor(executor, tensor)
        except Exception as e:  # noqa: BLE001 - raised on every rank by share_payload
            got = e
    return share_payload(world, got, n)
