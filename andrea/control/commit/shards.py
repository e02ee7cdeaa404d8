"""The sharded checkpoint commit: P ranks write ONE `step_NNNNNN.bin` that knows nothing of world size.

Writes `step_NNNNNN.bin` (format: andrea/rundir/checkpoint.py) and, through `before_commit`, what rank 0 owes beside it
(ledger fsync, `step_NNNNNN.state.json`, `.state.json`). Each ZeRO-1 rank holds the slice [lo, hi) of w, m and
v (andrea/control/parallel/zero.py); a rank's staging buffer (ShardImage) holds its w[lo:hi], m[lo:hi] and v[lo:hi].

The commit, on every rank's I/O thread, over the `io` group (andrea/control/parallel/distributed.py): one tiny collective, then
one message from each rank to rank 0 and one back.
    rank 0     claim the run directory's spare: rename it onto `step_N.bin.tmp` (andrea/rundir/spare.py)
    exchange   all-gather every rank's tails, the bytes of its slices that fall in a block another rank writes
               (under 4 KiB per slice; andrea/control/commit/shard_layout.py). Also the order: no rank opens the `.tmp`
               before rank 0's claim.
    every rank open the `.tmp` (the claimed spare, or created by whichever rank comes first; never truncated:
               another rank may already have written into it); put the tails it received in front of its
               slices; pwrite the whole blocks it owns, with O_DIRECT from its ShardImage (the rank writing the
               last block then cuts the file to 8 + 12·n); fsync. Rank 0 first runs before_commit (ledger
               fsync, companions) while the others already write.
    vote       every rank to rank 0: 0 when its blocks (rank 0: and companions) are durable, else its rank + 1
    rank 0     no failure: rename onto `step_N.bin`, fsync the directory (checkpoint_write.publish_checkpoint);
               a failure: remove the `.tmp`
    verdict    rank 0 to every rank: 0 (committed) or the failing rank + 1 (rank 0's own, a failed publish
               included). Every rank learns the same outcome, so every rank keeps the same `last_committed`
               and takes the same decisions; a rank leaves a failed commit only once the `.tmp` is gone. Rank 0
               sends it and returns (then applies retention: a released checkpoint becomes the spare), without
               the round trip an all-reduce would add to its commit.
It needs one run directory that every rank sees (a shared filesystem): control/parallel/sharing.py probes that at start,
and ranks on separate disks commit through control/commit/gathered.py instead (`writer_for`).
The atomic protocol of one process, unchanged: the rename is the commit point, and it happens only after every
rank's blocks are fsynced. Every block of the file has exactly one writer, and every write is whole, aligned
blocks: no page cache, no read-modify-write of a block two ranks share, no buffered write waiting for the inode
behind the other ranks' O_DIRECT writes. A rank that dies anywhere before its vote leaves a `.tmp` at most
(removed at the next start); after rank 0's rename, the checkpoint is complete.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from andrea.control.commit.gathered import GatheredCheckpointWriter
from andrea.control.commit.shard_layout import ShardImage
from andrea.control.commit.writer import CheckpointWriter, CommitFailed
from andrea.control.parallel.distributed import World
from andrea.rundir import checkpoint as ckpt, checkpoint_write, checksum, names, spare
from andrea.rundir.retention import Retention

log = logging.getLogger("andrea.shards")


def write_blocks(path: Path, writes: list[tuple[int, memoryview]], direct: checkpoint_write.DirectIO,
                 size: int | None = None) -> None:
    """pwrite whole blocks (ShardImage.writes) into the shared file, with O_DIRECT while the filesystem takes
    it (a refusal when O_DIRECT is switched on, EINVAL, or at the first write, EINVAL or EFAULT as in
    checkpoint.py: said once, then buffered); with `size`
    (the rank that writes the last block) cut the file to its length; fsync.

    Opened with O_CREAT, never O_TRUNC: other ranks write into the same file, and a claimed spare's blocks are
    the point. No preallocation: with every rank writing from the first moment, a fallocate(2) of the whole
    file competes with their writes for the inode (measured on ext4: 2 writers at 0.92-0.94x one writer's
    throughput into a preallocated fresh file, 0.96x without). A full disk fails some rank's write instead, and
    rank 0 removes the `.tmp` on that rank's vote. fsync is per file, whichever descriptor wrote: each rank's
    covers its own blocks."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        on = False
        if direct.enabled and writes:
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
                on = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                direct.refuse(path, "open", e)
        for i, (off, view) in enumerate(writes):
            try:
                checkpoint_write.pwrite_all(fd, view, off)
            except OSError as e:
                if not (on and i == 0 and e.errno in checkpoint_write.DIRECT_REFUSED_AT_WRITE):
                    raise
                direct.refuse(path, "first write", e)
                fcntl.fcntl(fd, fcntl.F_SETFL, flags)
                on = False
                checkpoint_write.pwrite_all(fd, view, off)
        if size is not None:
            os.ftruncate(fd, size)  # after the padded last block; every other rank writes below it
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardFailure(CommitFailed):
    """A sharded commit that did not land; the message names the failing rank and the reason."""


def commit_shards(world: World, run_dir: Path, step: int, n: int, staged: ShardImage,
                  direct: checkpoint_write.DirectIO, *, before_commit: Callable[[], None] | None = None,
                  before_rename: Callable[[], None] | None = None) -> Path:
    """Every rank calls this with its staged slices; returns the committed path or raises ShardFailure on
    every rank alike. `before_commit` and `before_rename` run on rank 0 only."""
    final = run_dir / names.checkpoint_name(step)
    tmp = final.with_name(final.name + names.TMP_SUFFIX)
    error: list[str] = []

    def attempt(fn: Callable[[], object]) -> None:
        if error:
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every rank must vote, whatever went wrong
            error.append(f"{e.strerror or e}" if isinstance(e, OSError) else repr(e))

    def write(tails: list[torch.Tensor]) -> None:
        staged.fill(tails, ckpt.header(step, n))
        if world.leader and before_commit is not None:  # durable before the rename; overlaps the others' writes
            before_commit()
        write_blocks(tmp, staged.writes(), direct, ckpt.checkpoint_bytes(n) if staged.writes_last_block else None)

    def publish() -> None:
        # Rank 0 holds only its slices: the checksum is of the complete `.tmp`, read back once every vote says
        # its blocks are durable (on rank 0's I/O thread, off the training step; rundir/checksum.py).
        checksum.write(final, step, n, checksum.file_digests(tmp, n))
        if before_rename is not None:
            before_rename()
        checkpoint_write.publish_checkpoint(tmp, final)

    if world.leader:
        attempt(lambda: spare.claim(tmp))
    tails = world.all_gather_bytes(staged.tails(), group="io")  # after it, no rank opens the .tmp too early
    attempt(lambda: write(tails))
    votes = world.to_leader(world.rank + 1 if error else 0)
    if world.leader:
        failed = max(votes)
        if not failed:
            attempt(publish)
            failed = 1 if error else 0
        if failed:  # before the verdict, so no rank still writes into it when a later commit opens the name
            try:
                tmp.unlink(missing_ok=True)
                if not final.exists():
                    checksum.sum_path(final).unlink(missing_ok=True)
            except OSError as e:  # the verdict must go out: the next start removes a `.tmp`
                log.error("%s: could not remove the failed commit's file: %s", tmp, e.strerror or e)
        world.from_leader(failed)
    else:
        failed = world.from_leader(0)
    if failed:
        why = error[0] if error else "see that rank's log"
        raise ShardFailure(f"{final}: checkpoint write failed on rank {failed - 1}: {why}")
    return final


class ShardedCheckpointWriter(CheckpointWriter):
    """CheckpointWriter (slots, back-pressure, results, retention) whose commit is `commit_shards`."""

    def __init__(self, run_dir: Path, n: int, world: World, device: torch.device, io, *,
                 retention: Retention, direct: bool = True):
        # The base's whole-file images are not used here: a 1-parameter placeholder (one 4 KiB page) keeps
        # its bookkeeping (slots, results, retention) without allocating a second state.
        super().__init__(run_dir, 1, device, io, retention=retention, direct=direct)
        self.total_n, self.world, self.rank, self.owns_files = n, world, world.rank, world.leader
        # This rank's slice bounds are the ZeroTrainer's: both are world.shard_bounds(n) (the run's cuts, if any).
        self.images = [ShardImage(n, world.size, world.rank, pinned=device.type == "cuda", cuts=world.cuts)
                       for _ in range(2)]
        self.staging = [image.views for image in self.images]  # (w[lo:hi], m[lo:hi], v[lo:hi]) per slot

    def _write(self, slot: int, step: int, before_commit: Callable[[], None] | None,
               before_rename: Callable[[], None] | None) -> Path:
        return commit_shards(self.world, self.run_dir, step, self.total_n, self.images[slot], self.direct,
                             before_commit=before_commit, before_rename=before_rename)


def writer_for(world: World, run_dir: Path, trainer, device: torch.device, io, **kw) -> CheckpointWriter:
    """The one-process writer; for a ZeroTrainer the sharded one, or the gathered one when the ranks do not share
    the run directory (control/parallel/sharing.py, control/commit/gathered.py); kw: CheckpointWriter's."""
    if not world.distributed:
        return CheckpointWriter(run_dir, trainer.n, device, io, **kw)
    if not world.shared_dir:
        return GatheredCheckpointWriter(run_dir, trainer.n, world, device, io, **kw)
    return ShardedCheckpointWriter(run_dir, trainer.n, world, device, io, **kw)
