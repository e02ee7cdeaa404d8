"""Asynchronous checkpoints: snapshot `[w | m | v]` into a staging buffer, commit it on the I/O thread.

Writes `step_NNNNNN.bin` (format: andrea/rundir/checkpoint.py; its write and commit: rundir/checkpoint_write.py)
and removes what retention releases (the run's one policy, rundir/retention.py, handed in at construction), with each checkpoint's companion files (`step_NNNNNN.*.json`, written by
`before_commit`): a released `.bin` becomes `spare.ckpt`, whose blocks the next commit overwrites (rundir/spare.py).
`CheckpointWriter._commit` is the frame every writer's commit shares (fence, timing, retention, `CommitResult`,
companions removed on failure); the sharded and gathered writers (control/commit/shards.py, control/commit/gathered.py) replace
only `_write`.

Cost to the training loop: only the snapshot, a copy into a preallocated staging buffer hidden behind the
next forward and backward (Trainer.snapshot): on CUDA a non-blocking device-to-host copy into pinned memory on
a side stream, on CPU a memcpy on the trainer's copy thread. The commit starts by waiting on that copy's fence;
the next optimizer update waits on it too. Two staging buffers are allocated once and reused: at most one
commit in flight and one snapshot staged. A checkpoint due while both are busy waits for the older commit
(logged back-pressure): memory stays bounded and no buffer is reused while the I/O thread still reads it.

Each staging buffer is a whole file image (checkpoint.py): `images[i]`, uint8 of `image_bytes(n)` at a
DIRECT_ALIGN-aligned host address, and `staging[i]`, its float32 view of 3·n at byte 8, which is what
`Trainer.snapshot` fills. The commit writes the header into bytes 0..7 and hands the image to the disk with
O_DIRECT: no copy on the I/O thread, no page cache, so the commit costs the training threads next to no CPU
(`CommitResult.cpu_seconds`, the I/O thread's time.thread_time() over the commit, is logged with each commit).
A filesystem that refuses O_DIRECT is told once in the log and then written buffered (`direct.refusal`).

Test hook (andrea/testhooks.py): `ANDREA_TEST_COMMIT_DELAY=<seconds>` sleeps after the temporary file is complete
and before the rename, to make the commit window observable to the fault suite. Never set in production.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from andrea import testhooks
from andrea.control.observe.watchdog import test_hang
from andrea.rundir import checkpoint as ckpt, checkpoint_write, names, spare
from andrea.rundir.retention import Retention

if TYPE_CHECKING:
    from andrea.control.run.trainer import Fence  # a CUDA event or a HostCopy

log = logging.getLogger("andrea.writer")
HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) transparent huge page size


@dataclass
class CommitResult:
    step: int
    path: Path | None
    seconds: float  # wall time of the commit on the I/O thread after the snapshot's fence (before_commit,
    # write, rename, retention)
    error: str | None = None
    cpu_seconds: float = 0.0  # the I/O thread's CPU (user + sys) over the same span, after the fence
    direct: bool = False  # the .bin went out with O_DIRECT (False: buffered, by choice or after a refusal)


def staging_image(n: int, pinned: bool) -> torch.Tensor:
    """A zeroed uint8 tensor of image_bytes(n) at a DIRECT_ALIGN-aligned host address (pinned when asked)."""
    return aligned_host_buffer(checkpoint_write.image_bytes(n), pinned)


def aligned_host_buffer(size: int, pinned: bool) -> torch.Tensor:
    """A zeroed uint8 tensor of `size` bytes at a DIRECT_ALIGN-aligned host address (pinned when asked).

    A private anonymous mmap advised for transparent huge pages, sliced at a 2 MiB boundary. O_DIRECT pins the
    buffer's pages for every write; in 2 MiB folios that costs a fraction of the CPU of 4 KiB pages, and the
    device gets longer DMA segments (measured on this repository's CI disk: ~1 ms instead of ~5 ms of CPU and
    ~0.05 s instead of ~0.1 s for ANDREA-12M). CUDA (`pinned`): the slice itself is then page-locked for the
    device-to-host copy (`register_host`), exactly `size` bytes. Not pin_memory=True: PyTorch's pinned
    allocator rounds every block up to a power of two, so ANDREA-120M's 1.44 GB image would lock 2 GiB (two
    images: ~1.1 GB of RAM locked for nothing). The slack in front of and behind the slice is never touched.
    Zeroed now so the first snapshots do not pay for faulting in fresh pages on the training loop.
    """
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    array = np.frombuffer(region, dtype=np.uint8)  # the array keeps the mapping alive, the tensor the array
    raw = torch.from_numpy(array)
    skip = -raw.data_ptr() % HUGE_PAGE
    image = raw[skip:skip + size].zero_()
    if pinned and not register_host(array, image.data_ptr(), size):  # refused: PyTorch's pinned allocator
        raw = torch.zeros(size + checkpoint_write.DIRECT_ALIGN, dtype=torch.uint8, pin_memory=True)
        skip = -raw.data_ptr() % checkpoint_write.DIRECT_ALIGN
        return raw[skip:skip + size]
    return image


def register_host(owner: np.ndarray, ptr: int, size: int) -> bool:
    """Page-lock [ptr, ptr + size) of `owner`'s memory for CUDA copies (cudaHostRegister) until `owner` dies;
    False (said in the log) when the driver refuses.

    The unregistration is a finalizer on `owner`, the array every tensor over the memory keeps alive: numpy
    calls it before releasing its base (the mmap), so memory is never unmapped while still registered.
    """
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(ptr, size, 1))  # 1: cudaHostRegisterPortable, as torch's own helper
    if err != 0:
        log.warning("cudaHostRegister of a %d-byte staging buffer failed (CUDA error %d): using PyTorch's pinned "
                    "allocator, which locks the next power of two", size, err)
        return False
    done = weakref.finalize(owner, cudart.cudaHostUnregister, ptr)
    done.atexit = False  # at exit the driver releases it; CUDA may already be torn down
    return True


class CommitFailed(Exception):
    """A commit that did not land, its message whole (the sharded and gathered commits: which rank, and why)."""


class CheckpointWriter:
    """Two staging buffers, back-pressure, the commits on the I/O thread, their results and retention; the one
    process's commit (`_write`), which control/commit/shards.py and control/commit/gathered.py replace."""

    rank = 0  # this process's rank (the ANDREA_TEST_HANG hook names one)
    owns_files = True  # this rank writes the run directory: retention and companions are its to remove

    def __init__(self, run_dir: Path, n: int, device: torch.device, io: Executor, *, retention: Retention,
                 direct: bool = True):
        self.run_dir = run_dir
        self.io = io
        self.retention = retention  # keep_last, keep_every, keep_best and the spared steps, read at each retention
        self.n = n
        self.images = [staging_image(n, pinned=device.type == "cuda") for _ in range(2)]
        self.staging = [image[ckpt.HEADER.size:ckpt.HEADER.size + 12 * n].view(torch.float32)
                        for image in self.images]  # (3n,) fp32 = [w | m | v], byte 8 of the file
        self.direct = checkpoint_write.DirectIO(direct)  # direct=False: today's buffered writes (the bench's baseline)
        self._busy: list[asyncio.Future | None] = [None, None]
        self.last_committed: int | None = None
        self._reported: set[str] = set()  # retention's warnings already logged
        # the first failed commit's error since the newest one that succeeded (None: that one is the newest): a
        # boundary that learns of failures late (the I/O thread behind) names the write that failed first
        self.first_error: str | None = None
        self.stall_seconds: list[float] = []
        self.delay = testhooks.commit_delay()  # test hook ANDREA_TEST_COMMIT_DELAY (andrea/testhooks.py)

    async def free_slot(self) -> int:
        """Index of a staging buffer no commit is using; waits (back-pressure) when both are busy."""
        for i, fut in enumerate(self._busy):
            if fut is None or fut.done():
                return i
        log.warning("checkpoint back-pressure: the disk is slower than the cadence; waiting for the "
                    "previous commit before staging a new snapshot")
        await asyncio.wait([f for f in self._busy if f is not None], return_when=asyncio.FIRST_COMPLETED)
        return await self.free_slot()

    def start_commit(self, slot: int, step: int, fence: Fence | None,
                     before_commit: Callable[[], None] | None = None) -> asyncio.Future:
        """Schedule the commit of staging buffer `slot` (snapshot of `step`) on the I/O thread.

        `before_commit` runs there first (ledger fsync, companion state files): a `.bin` is never committed
        before what it vouches for.
        """
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(self.io, self._commit, slot, step, fence, before_commit)
        self._busy[slot] = fut
        fut.add_done_callback(self._finished)
        return fut

    def _commit(self, slot: int, step: int, fence: Fence | None,
                before_commit: Callable[[], None] | None) -> CommitResult:
        """The frame of every writer's commit, on the I/O thread: the snapshot's fence, the commit's wall and CPU
        time from the fence on, `_write`, retention where this rank writes the run directory, and on a failure
        the reason in the result and the companions of a checkpoint that never landed removed."""
        t0, cpu0 = time.perf_counter(), time.thread_time()
        test_hang("io", step, self.rank)  # test hook ANDREA_TEST_HANG=io@<step> (andrea/testhooks.py)
        try:
            if fence is not None:
                fence.synchronize()  # the snapshot's copy (a blocking event: sleeps): not the commit's time or CPU
                t0, cpu0 = time.perf_counter(), time.thread_time()
            hold = (lambda: time.sleep(self.delay)) if self.delay else None
            path = self._write(slot, step, before_commit, hold)
            if self.owns_files:
                self.retain(path)
            return CommitResult(step, path, time.perf_counter() - t0, cpu_seconds=time.thread_time() - cpu0,
                                direct=self.direct.enabled)
        except (OSError, CommitFailed) as e:
            final = self.run_dir / names.checkpoint_name(step)
            if self.owns_files and not final.exists():  # companions of a checkpoint that never landed: only space
                self._remove_companions(step)
            reason = str(e) if isinstance(e, CommitFailed) else f"{final}: checkpoint write failed: {e.strerror or e}"
            return CommitResult(step, None, time.perf_counter() - t0, reason, time.thread_time() - cpu0,
                                self.direct.enabled)

    def _write(self, slot: int, step: int, before_commit: Callable[[], None] | None,
               before_rename: Callable[[], None] | None) -> Path:
        """Commit staging buffer `slot` as `step_NNNNNN.bin`: one process writes the whole image
        (rundir/checkpoint_write.py); the sharded and gathered writers replace this. Raises OSError or CommitFailed."""
        if before_commit is not None:
            before_commit()
        return checkpoint_write.commit_image(self.run_dir, step, self.images[slot].numpy(), self.n,
                                             direct=self.direct, before_rename=before_rename)

    def _finished(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        result: CommitResult = fut.result()
        if result.error:
            self.first_error = self.first_error or result.error
            log.error("%s", result.error)
        else:
            self.last_committed = max(result.step, self.last_committed or 0)
            self.first_error = None
            log.info("checkpoint %s committed in %.2fs (I/O thread CPU %.3fs, %s)", result.path.name,
                     result.seconds, result.cpu_seconds, "O_DIRECT" if result.direct else "buffered")

    def retain(self, committed: Path) -> None:
        """Retention after `committed` landed; its failure is logged, never the commit's (an old checkpoint left
        behind is only disk space)."""
        try:
            self._apply_retention()
        except OSError as e:
            log.error("%s: retention after %s failed: %s", self.run_dir, committed.name, e)

    def _apply_retention(self) -> None:
        problems = [f"{p} is not a regular file: not a checkpoint, left alone"
                    for p in ckpt.foreign_entries(self.run_dir)] + [spare.blocked(self.run_dir)]
        for problem in problems:
            if problem is not None and problem not in self._reported:  # once per process, not once per commit
                self._reported.add(problem)
                log.warning("%s", problem)
        steps = [s for s, _ in ckpt.list_checkpoints(self.run_dir)]
        for step in self.retention.victims(steps):
            spare.retire(self.run_dir / names.checkpoint_name(step))  # each replaces the one before
            self._remove_companions(step)

    def _remove_companions(self, step: int) -> None:
        """Delete `step_NNNNNN.*.json`, the files that belong to one checkpoint."""
        for companion in names.companions(self.run_dir, step):
            companion.unlink(missing_ok=True)

    async def drain(self) -> list[CommitResult]:
        """Wait for every commit in flight; return their results."""
        futs = [f for f in self._busy if f is not None]
        return list(await asyncio.gather(*futs)) if futs else []

