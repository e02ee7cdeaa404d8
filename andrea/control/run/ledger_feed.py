"""The training loop's side of the loss ledger: lines batched on the event loop, appended on the I/O thread and
fsynced on a cadence. The file itself (`.loss.json`: its format, writer and reader) is andrea/rundir/ledger.py.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any

from andrea.rundir.ledger import LossLedger

log = logging.getLogger("andrea.control.run")


class LedgerFeed:
    """The training loop's side of the ledger: lines collect in `lines` on the event loop and go to the I/O
    thread (`io`, FIFO: an append queued before a checkpoint's commit lands before it) at most every FLUSH_S
    seconds or every MAX_LINES lines, fsynced at least every FSYNC_S. A failed append is logged and its lines
    stay in the ledger's backlog, retried first by the next one. `on_flush(lines)` sees every batch handed over
    (the TensorBoard log); `clock` is injectable so the cadence is testable without sleeping."""

    FLUSH_S, FSYNC_S, MAX_LINES = 1.0, 5.0, 512

    def __init__(self, ledger: LossLedger, io: Executor, clock: Callable[[], float] = time.monotonic):
        self.ledger, self.io, self.clock = ledger, io, clock
        self.lines: list[dict[str, Any]] = []
        self.on_flush: Callable[[list[dict[str, Any]]], None] | None = None
        self.last_flush = self.last_fsync = clock()
        self._queued: Future | None = None

    def flush(self, force_sync: bool = False) -> None:
        """Hand the buffered lines to the I/O thread when due (always with `force_sync`, and then fsynced)."""
        now = self.clock()
        sync = force_sync or now - self.last_fsync >= self.FSYNC_S
        if not (sync or now - self.last_flush >= self.FLUSH_S or len(self.lines) >= self.MAX_LINES):
            return
        lines, self.lines = self.lines, []
        self._queued = self.io.submit(self._append, lines, sync)
        if self.on_flush is not None:
            self.on_flush(lines)
        self.last_flush = now
        if sync:
            self.last_fsync = now

    def wait(self) -> None:
        """Until the last append handed over has run."""
        if self._queued is not None:
            self._queued.result()

    def _append(self, lines: list[dict[str, Any]], sync: bool) -> None:
        try:
            self.ledger.append(lines)
            if sync:
                self.ledger.sync()
        except OSError as e:
            log.error("%s: append failed, %d lines kept to retry: %s", self.ledger.path, self.ledger.backlog, e)
