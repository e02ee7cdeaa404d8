"""The sharded checkpoint commit: P ranks write ONE `step_NNNNNN.bin` that knows nothing of world size.

Writes `step_NNNNNN.bin` (format: andrea/checkpoint.py) and, through `before_commit`, what rank 0 owes beside it
(ledger fsync, `step_NNNNNN.state.json`, `.state.json`). Each ZeRO-1 rank holds the slice [lo, hi) of w, m and
v (andrea/zero.py); a rank's staging buffer (ShardImage) holds its w[lo:hi], m[lo:hi] and v[lo:hi].

The commit, on every rank's I/O thread, two tiny agreements on the `io` group (andrea/distributed.py):
    rank 0     before_commit (ledger fsync, companions), while the other ranks already write
    every rank open the file: rank 0 renames the spare onto `step_N.bin.tmp`, the others open it by
               either name (andrea/spare.py); with no spare, whichever rank comes first creates the `.tmp`.
               Never truncated: another rank may already have written into it. pwrite its three slices at
               8 + 4·lo, 8 + 4·(n + lo), 8 + 4·(2n + lo) (rank 0 also the header, and sets the length
               8 + 12·n); fsync
    agree 1    (every slice and companion is durable, or someone failed: rank 0 removes the .tmp)
    rank 0     rename onto `step_N.bin`, fsync the directory (checkpoint.publish_checkpoint); retention
               (a released checkpoint becomes the spare, andrea/spare.py)
    agree 2    (everyone learns the outcome: the same `last_committed` on every rank, so the same decisions)
The atomic protocol of one process, unchanged: the rename is the commit point, and it happens only after every
slice is fsynced. Every byte of [0, 8 + 12·n) is written by exactly one rank (the header and each slice), so the
`.tmp` needs no agreement before the writes: no rank waits for another to create it, nor for rank 0's
companions. A rank that dies anywhere before agree 1 leaves a `.tmp` at most (removed at the next start); after
it, the checkpoint is complete. Like the single writer, the slices go out with O_DIRECT where the filesystem
takes it: a rank stages each slice at a host address congruent to its file offset (ShardImage), so the
block-aligned middle is written straight from there; the partial blocks at a slice's ends (under 4 KiB each,
shared with a neighbour's slice) are written buffered, and the one fsync makes both durable.

Failure: agreement values carry rank + 1 of a failing rank (MAX), so every rank reports the same failure.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from andrea import checkpoint as ckpt, spare
from andrea.control.writer import CheckpointWriter, CommitResult, aligned_host_buffer
from andrea.distributed import World

if TYPE_CHECKING:
    from andrea.trainer import Fence  # a CUDA event or a HostCopy

log = logging.getLogger("andrea.shards")


ALIGN = ckpt.DIRECT_ALIGN


class ShardImage:
    """One staging buffer of a rank: its three slices at host addresses congruent to their file offsets mod ALIGN.

    So the block-aligned middle of each slice goes to the disk with O_DIRECT straight from here (address, offset
    and length all aligned), like the single writer's image; only the partial blocks at each slice's two ends
    (under ALIGN bytes each, shared with the neighbouring rank's slice or the header) are written buffered.
    `views` = (w[lo:hi], m[lo:hi], v[lo:hi]) as float32 tensors: what ZeroTrainer.snapshot fills.
    """

    def __init__(self, n: int, lo: int, hi: int, pinned: bool):
        k = hi - lo
        self.offsets = [ckpt.HEADER.size + 4 * (r * n + lo) for r in range(3)]  # file byte offsets
        self.starts, pos = [], 0
        for off in self.offsets:
            start = pos + (off - pos) % ALIGN  # the first position >= pos congruent to off
            self.starts.append(start)
            pos = start + 4 * k
        # The single writer's kind of buffer (2 MiB pages on CPU): O_DIRECT from 4 KiB pages costs ~2x the time.
        raw = aligned_host_buffer(pos + 2 * ALIGN, pinned)
        skip = -raw.data_ptr() % ALIGN
        self.image = raw[skip:skip + pos + ALIGN]
        self.nbytes = 4 * k
        self.views = tuple(self.image[a:a + 4 * k].view(torch.float32) for a in self.starts)

    def pieces(self) -> list[tuple[int, memoryview, bool]]:
        """(file offset, bytes, aligned) for the whole slice set: aligned pieces may go O_DIRECT."""
        mem = memoryview(self.image.numpy()).cast("B")
        out = []
        for off, start in zip(self.offsets, self.starts):
            end = off + self.nbytes
            a, b = min(-(-off // ALIGN) * ALIGN, end), max(end // ALIGN * ALIGN, off)
            if b <= a:  # no whole block inside: all buffered
                out.append((off, mem[start:start + self.nbytes], False))
                continue
            for lo_, hi_, aligned in ((off, a, False), (a, b, True), (b, end, False)):
                if hi_ > lo_:
                    out.append((lo_, mem[start + lo_ - off:start + hi_ - off], aligned))
        return out


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    for lo in range(0, len(view), ckpt.WRITE_CHUNK):
        chunk, written = view[lo:lo + ckpt.WRITE_CHUNK], 0
        while written < len(chunk):
            written += os.pwrite(fd, chunk[written:], offset + lo + written)


def write_into(path: Path, pieces: list[tuple[int, memoryview, bool]], direct: ckpt.DirectIO, *,
               leader: bool, size: int | None = None) -> None:
    """pwrite the pieces into the shared file, the aligned ones first and with O_DIRECT while the filesystem
    takes it (a refusal: said once, then buffered), then the rest buffered; with `size` (rank 0) set the file's
    length; fsync.

    The file: rank 0 claims the run directory's spare onto `path` and opens that; the others open the spare by
    whichever name it has at that moment (spare.open_for_commit); with no spare, whichever rank comes first
    creates `path`. Never O_TRUNC (other ranks write into the same file; the spare's blocks are the point) and no
    preallocation: with every rank writing from the first moment, a fallocate(2) of the whole file competes with
    their writes for the inode (measured on ext4: 2 writers at 0.92-0.94x one writer's throughput with a
    preallocated fresh file, 0.96x without). A full disk fails some rank's write instead, and the agreement
    removes the `.tmp`. fsync is per file, whichever descriptor wrote: each rank's covers its own pieces."""
    if leader:
        spare.claim(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    else:
        fd = spare.open_for_commit(path)
    try:
        aligned = [(off, view) for off, view, ok in pieces if ok]
        if direct.enabled and aligned:
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                direct.refuse(path, "open", e)
            else:
                try:
                    for i, (off, view) in enumerate(aligned):
                        try:
                            _pwrite(fd, view, off)
                        except OSError as e:
                            if i or e.errno != errno.EINVAL:
                                raise
                            direct.refuse(path, "first write", e)
                            break
                finally:
                    fcntl.fcntl(fd, fcntl.F_SETFL, flags)
        for off, view, ok in pieces:
            if not (ok and direct.enabled):
                _pwrite(fd, view, off)
        if size is not None:
            os.ftruncate(fd, size)  # never below another rank's bytes: every rank writes inside [0, size)
        os.fsync(fd)
    finally:
        os.close(fd)


class ShardFailure(Exception):
    """A sharded commit that did not land; the message names the failing rank and the reason."""


def commit_shards(world: World, run_dir: Path, step: int, n: int, staged: ShardImage, direct: ckpt.DirectIO, *,
                  before_commit: Callable[[], None] | None = None,
                  before_rename: Callable[[], None] | None = None,
                  after_publish: Callable[[], None] | None = None) -> Path:
    """Every rank calls this with its staged slices; returns the committed path or raises ShardFailure on
    every rank alike. The hooks run on rank 0 only; `after_publish` (retention) runs once the checkpoint is
    committed and before the last agreement, so a spare it retires exists before any rank's next commit opens
    one; its errors are logged, never the commit's."""
    final = run_dir / ckpt.checkpoint_name(step)
    tmp = final.with_name(final.name + ckpt.TMP_SUFFIX)
    error: list[str] = []

    def attempt(fn: Callable[[], object]) -> None:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every rank must reach the agreement, whatever went wrong
            error.append(f"{e.strerror or e}" if isinstance(e, OSError) else repr(e))

    def agree() -> None:
        failed = world.max_ints([world.rank + 1 if error else 0], group="io")[0]
        if failed:
            if world.leader:
                tmp.unlink(missing_ok=True)
            # Nobody leaves before the .tmp is gone: a later commit of the same step (after a rollback) opens
            # that name again without truncating it, and must never find this attempt's bytes or lose its own.
            world.max_ints([0], group="io")
            why = error[0] if error else "see that rank's log"
            raise ShardFailure(f"{final}: checkpoint write failed on rank {failed - 1}: {why}")

    def write() -> None:
        pieces, size = staged.pieces(), None
        if world.leader:
            if before_commit is not None:  # durable before the rename; its fsyncs overlap the others' writes
                before_commit()
            pieces, size = pieces + [(0, memoryview(ckpt.header(step, n)), False)], ckpt.checkpoint_bytes(n)
        write_into(tmp, pieces, direct, leader=world.leader, size=size)

    def publish() -> None:
        if before_rename is not None:
            before_rename()
        ckpt.publish_checkpoint(tmp, final)

    attempt(write)
    agree()
    if world.leader:
        attempt(publish)
        if not error and after_publish is not None:
            try:
                after_publish()
            except OSError as e:  # the checkpoint is committed; an old one left behind is only space
                log.error("%s: retention after %s failed: %s", run_dir, final.name, e)
    agree()
    return final


class ShardedCheckpointWriter(CheckpointWriter):
    """CheckpointWriter (slots, back-pressure, results, retention) whose commit is `commit_shards`."""

    def __init__(self, run_dir: Path, n: int, lo: int, hi: int, world: World, device: torch.device, io, *,
                 keep_last: int, keep_every: int, direct: bool = True):
        # The base's whole-file images are not used here: a 1-parameter placeholder (one 4 KiB page) keeps
        # its bookkeeping (slots, results, retention, protected steps) without allocating a second state.
        super().__init__(run_dir, 1, device, io, keep_last=keep_last, keep_every=keep_every, direct=direct)
        self.total_n, self.lo, self.hi, self.world = n, lo, hi, world
        self.images = [ShardImage(n, lo, hi, pinned=device.type == "cuda") for _ in range(2)]
        self.staging = [image.views for image in self.images]  # (w[lo:hi], m[lo:hi], v[lo:hi]) per slot

    def _commit(self, slot: int, step: int, fence: Fence | None,
                before_commit: Callable[[], None] | None) -> CommitResult:
        t0, cpu0 = time.perf_counter(), time.thread_time()
        if fence is not None:
            fence.synchronize()  # the snapshot's copy: not the commit's time or CPU
            t0, cpu0 = time.perf_counter(), time.thread_time()
        hold = (lambda: time.sleep(self.delay)) if self.delay else None
        try:
            path = commit_shards(self.world, self.run_dir, step, self.total_n, self.images[slot], self.direct,
                                 before_commit=before_commit, before_rename=hold,
                                 after_publish=self._apply_retention)
            return CommitResult(step, path, time.perf_counter() - t0, cpu_seconds=time.thread_time() - cpu0,
                                direct=self.direct.enabled)
        except ShardFailure as e:
            if self.world.leader and not (self.run_dir / ckpt.checkpoint_name(step)).exists():
                self._remove_companions(step)
            return CommitResult(step, None, time.perf_counter() - t0, str(e), time.thread_time() - cpu0)


def writer_for(world: World, run_dir: Path, trainer, device: torch.device, io, **kw) -> CheckpointWriter:
    """The one-process writer, or the sharded one for a ZeroTrainer (its slice bounds); kw: CheckpointWriter's."""
    if not world.distributed:
        return CheckpointWriter(run_dir, trainer.n, device, io, **kw)
    return ShardedCheckpointWriter(run_dir, trainer.n, trainer.lo, trainer.hi, world, device, io, **kw)
