"""What the ranks of a data-parallel run agree on at each step boundary, and what only rank 0 does.

Writes no files itself: `prepare_data` has andrea/data prepare them on rank 0 (on separate disks, on the first rank
of each disk too), and `data_fingerprint` reads a rank's `data/manifest.json`. Under torchrun a signal reaches the
workers at different moments (the launcher forwards SIGTERM/SIGINT to each in turn; SLURM may signal
only some; `andrea ctl` and SIGHUP reach rank 0 alone, through `train.pid`), and a commit's outcome reaches each
rank's event loop at its own moment. So at every boundary, before `boundary_action`, the ranks exchange their
requests in ONE tiny all-reduce MAX of four int64 (`share`), and every rank then decides from the same merged
Requests — the same checkpoint for the same step, the same stop, the same pivot, the same failure:

    index  meaning       encoding (0 = nothing requested)
    0      stop          1 SIGTERM, 2 SIGINT, 3 any other reason (MAX: one of them; only the log line differs)
    1      checkpoint    FAR - checkpoint_at, so MAX is the EARLIEST pending request (one checkpoint, the first due)
    2      pivot         1 when a hot pivot (SIGHUP on some rank) is pending
    3      failed        1 when a checkpoint write failed under `checkpoint.on_write_error = "stop"`: every rank
                         exits 1 at this boundary (none is left waiting in the next step's collectives)

`decide` is the pure merge (what the all-reduce computes, then decoded), tested without processes; `merge` applies
an agreement to one rank's Requests. A rank that learns of a pivot from another reads the same
`RUN_DIR/policy.next.toml` (a shared run directory), before rank 0's archive could remove it: the archive
runs after the pivot checkpoint's commit, which needs every rank. On separate disks (control/parallel/sharing.py) the
policy is rank 0's, sent to every rank at each boundary while the pivot is pending (`leader_policy`).

`prepare_data`: rank 0 prepares the run's data (andrea/data/preparation.py) while the others wait at a barrier, then
they map the same files; an interruption or a data error on rank 0 reaches every rank, so none is left waiting.
On separate disks the first rank of each directory prepares that directory's copy at the same time as rank 0
(preparation is deterministic: the same sources, tokenizer sample and encoding give the same bytes), and every
rank's `data_fingerprint` must equal rank 0's before any step trains on it.

`FollowerLedger`: the loss ledger as ranks other than 0 hold it: lines are dropped (rank 0 writes the one truth).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from andrea.config.schema import RunConfig
from andrea.control.run.signals import Requests
from andrea.data import manifest as mf, store
from andrea.data.preparation import Interrupted
from andrea.data.sources import DataError
from andrea.control.parallel.distributed import World
from andrea.rundir import names

log = logging.getLogger("andrea.ranks")

STOP_NAMES = ("SIGTERM", "SIGINT")
FAR = 1 << 62


FAILED_ELSEWHERE = 'a checkpoint write failed on another rank (checkpoint.on_write_error = "stop"); see its log'


@dataclass(frozen=True)
class Agreed:
    stop: str | None = None
    checkpoint_at: int | None = None
    pivot: bool = False
    failed: bool = False


def encode(req: Requests) -> list[int]:
    """One rank's pending requests as the vector the ranks all-reduce (MAX)."""
    stop = 0 if req.stop is None else (STOP_NAMES.index(req.stop) + 1 if req.stop in STOP_NAMES else 3)
    checkpoint = 0 if req.checkpoint_at is None else FAR - req.checkpoint_at
    return [stop, checkpoint, int(req.pivot), int(req.failed is not None)]


def decode(vector: list[int]) -> Agreed:
    stop, checkpoint, pivot, failed = vector
    name = None if stop == 0 else (STOP_NAMES[stop - 1] if stop <= len(STOP_NAMES) else "stop on another rank")
    return Agreed(name, None if checkpoint == 0 else FAR - checkpoint, bool(pivot), bool(failed))


def decide(vectors: list[list[int]]) -> Agreed:
    """Every rank's encoded requests -> the one agreed action (elementwise MAX, as the all-reduce)."""
    return decode([max(column) for column in zip(*vectors, strict=True)])


def merge(req: Requests, agreed: Agreed) -> bool:
    """Fold the agreement into this rank's requests; True when a pivot is learned from another rank."""
    if agreed.stop is not None and req.stop is None:
        req.stop = agreed.stop
        log.warning("%s reached another rank: stopping at this step boundary with the others", agreed.stop)
    if agreed.checkpoint_at is not None and (req.checkpoint_at is None or agreed.checkpoint_at < req.checkpoint_at):
        req.checkpoint_at = agreed.checkpoint_at
    if agreed.failed and req.failed is None:
        req.failed = FAILED_ELSEWHERE
    learned = agreed.pivot and not req.pivot
    req.pivot = req.pivot or agreed.pivot
    return learned


def share(world: World, req: Requests) -> bool:
    """The boundary exchange (no-op for one process); True when this rank must load the pivot policy."""
    if not world.distributed:
        return False
    return merge(req, decode(world.max_ints(encode(req))))


class FollowerLedger:
    """LossLedger's interface for ranks other than 0: appends are dropped, nothing is opened or synced."""

    torn_bytes = 0
    backlog = 0

    def __init__(self, path: Path):
        self.path = path

    def append(self, records: list[dict]) -> None:
        pass

    def sync(self) -> None:
        pass

    def seal(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def prepares(world: World) -> bool:
    """Whether this rank prepares data: rank 0, and on separate disks the first rank seeing each directory."""
    return world.leader or (not world.shared_dir and world.view == world.rank)


def prepare_data(world: World, cfg: RunConfig, run_dir: Path, should_stop) -> tuple:
    """(codec, arms) on every rank; the preparing ranks alone write. Raises Interrupted or DataError on every rank
    alike."""
    data, model = cfg.data, cfg.model
    result, outcome = None, None
    if prepares(world):
        try:
            result = store.prepare(data, run_dir, model.vocab_size, model.block_size, should_stop=should_stop)
        except (Interrupted, DataError) as e:
            outcome = (type(e).__name__, str(e))
    world.barrier()
    outcomes = [world.broadcast(outcome)] if world.shared_dir else world.gather(outcome)
    outcome = next((o for o in outcomes if o is not None), None)
    if outcome is not None:
        raise (Interrupted if outcome[0] == "Interrupted" else DataError)(outcome[1])
    result = result if prepares(world) else store.prepare(data, run_dir, model.vocab_size, model.block_size)
    if not world.shared_dir:
        problem = fingerprint_mismatch(world.gather(data_fingerprint(run_dir)))
        if problem is not None:
            raise DataError(f"{run_dir}: {problem}")
    return result


def data_fingerprint(run_dir: Path) -> dict | None:
    """What the token stream depends on, from `data/manifest.json`: the tokenizer's hash, the token width and
    split, and each arm's token, document and text counts (no paths or times: those differ between nodes)."""
    manifest = mf.Manifest.load(run_dir / names.DATA_DIR)
    if manifest is None:
        return None
    arms = {name: [r.kind, r.complete, r.train_tokens, r.val_tokens, r.documents, r.text_bytes]
            for name, r in sorted(manifest.arms.items())}
    return {"tokenizer": manifest.tokenizer.get("sha256"), "dtype": manifest.dtype,
            "val_fraction": manifest.val_fraction, "arms": arms}


def fingerprint_mismatch(prints: list[dict | None]) -> str | None:
    """Every rank's data fingerprint (rank order) -> why some rank's data is not rank 0's, or None."""
    first = prints[0] or {}
    for rank, p in enumerate(prints):
        if p != prints[0]:
            what = [k for k in ("tokenizer", "dtype", "val_fraction", "arms") if (p or {}).get(k) != first.get(k)]
            return (f"rank {rank}'s copy of the prepared data differs from rank 0's ({', '.join(what)}): the nodes "
                    "prepared from different sources; give every node the same sources (or copy rank 0's "
                    "tokenizer.json and data/ to every node)")
    return None


def leader_policy(world: World, policy, read: Callable[[], object]):
    """On separate disks, while a pivot is pending: rank 0's policy on every rank (rank 0 reads its own
    `policy.next.toml` with `read` when only another rank was asked). None on every rank when rank 0 has
    none (said in the log); the pending pivot is then dropped by the caller."""
    error = None
    if world.leader and policy is None:
        try:
            policy = read()
        except Exception as e:  # noqa: BLE001 - every rank must learn that there is no policy
            error = str(e)
    policy, error = world.broadcast((policy, error) if world.leader else None)
    if policy is None:
        log.error("pivot asked on another rank, but rank 0 has no policy to pivot to (%s); training continues "
                  "unchanged", error)
    return policy
