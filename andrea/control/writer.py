"""Asynchronous checkpoints: snapshot `[w | m | v]` into a staging buffer, commit it on the I/O thread.

Writes `step_NNNNNN.bin` (format and commit protocol: andrea/checkpoint.py) and deletes what retention
releases, with each checkpoint's companion files (`step_NNNNNN.*.json`, written by `before_commit`).

Cost to the training loop: only the snapshot. On CUDA it is a non-blocking device-to-host copy into pinned
memory on a side stream, hidden behind the next forward and backward; on CPU a memcpy into a preallocated
buffer. Two staging buffers are allocated once and reused: at most one commit in flight and one snapshot
staged. A checkpoint due while both are busy waits for the older commit (logged back-pressure): memory stays
bounded and no buffer is reused while the I/O thread still reads it.

Test hook: `ANDREA_TEST_COMMIT_DELAY=<seconds>` sleeps after the temporary file is complete and before the
rename, to make the commit window observable to the fault suite. Never set in production.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import torch

from andrea import checkpoint as ckpt

log = logging.getLogger("andrea.writer")


@dataclass
class CommitResult:
    step: int
    path: Path | None
    seconds: float
    error: str | None = None


class CheckpointWriter:
    def __init__(self, run_dir: Path, n: int, device: torch.device, io: Executor, *, keep_last: int,
                 keep_every: int):
        self.run_dir = run_dir
        self.io = io
        self.keep_last, self.keep_every = keep_last, keep_every
        pinned = device.type == "cuda"
        # Zeroed now so the first snapshots do not pay for faulting in fresh pages on the training loop.
        self.staging = [torch.zeros(3 * n, dtype=torch.float32, pin_memory=pinned) for _ in range(2)]
        self._busy: list[asyncio.Future | None] = [None, None]
        self.last_committed: int | None = None
        self.last_error: str | None = None
        self.stall_seconds: list[float] = []
        self.delay = float(os.environ.get("ANDREA_TEST_COMMIT_DELAY", "0") or 0)

    async def free_slot(self) -> int:
        """Index of a staging buffer no commit is using; waits (back-pressure) when both are busy."""
        for i, fut in enumerate(self._busy):
            if fut is None or fut.done():
                return i
        log.warning("checkpoint back-pressure: the disk is slower than the cadence; waiting for the "
                    "previous commit before staging a new snapshot")
        await asyncio.wait([f for f in self._busy if f is not None], return_when=asyncio.FIRST_COMPLETED)
        return await self.free_slot()

    def start_commit(self, slot: int, step: int, fence: torch.cuda.Event | None,
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

    def _commit(self, slot: int, step: int, fence: torch.cuda.Event | None,
                before_commit: Callable[[], None] | None) -> CommitResult:
        t0 = time.perf_counter()
        try:
            if fence is not None:
                fence.synchronize()
            if before_commit is not None:
                before_commit()
            payload = self.staging[slot].numpy()
            hold = (lambda: time.sleep(self.delay)) if self.delay else None
            ckpt.commit_checkpoint(self.run_dir, step, payload, before_rename=hold)
            self._apply_retention()
            return CommitResult(step, self.run_dir / ckpt.checkpoint_name(step), time.perf_counter() - t0)
        except OSError as e:
            final = self.run_dir / ckpt.checkpoint_name(step)
            if not final.exists():  # companions of a checkpoint that never landed would only take space
                self._remove_companions(step)
            reason = f"{final}: checkpoint write failed: {e.strerror or e}"
            return CommitResult(step, None, time.perf_counter() - t0, reason)

    def _finished(self, fut: asyncio.Future) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        result: CommitResult = fut.result()
        if result.error:
            self.last_error = result.error
            log.error("%s", result.error)
        else:
            self.last_committed = max(result.step, self.last_committed or 0)
            self.last_error = None
            log.info("checkpoint %s committed in %.2fs", result.path.name, result.seconds)

    def _apply_retention(self) -> None:
        steps = [s for s, _ in ckpt.list_checkpoints(self.run_dir)]
        for step in ckpt.retention_victims(steps, self.keep_last, self.keep_every):
            (self.run_dir / ckpt.checkpoint_name(step)).unlink(missing_ok=True)
            self._remove_companions(step)

    def _remove_companions(self, step: int) -> None:
        """Delete `step_NNNNNN.*.json`, the files that belong to one checkpoint."""
        for companion in self.run_dir.glob(f"{Path(ckpt.checkpoint_name(step)).stem}.*.json"):
            companion.unlink(missing_ok=True)

    async def drain(self) -> list[CommitResult]:
        """Wait for every commit in flight; return their results."""
        futs = [f for f in self._busy if f is not None]
        return list(await asyncio.gather(*futs)) if futs else []

