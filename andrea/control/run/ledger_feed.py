"""The training loop's side of the loss ledger, from its opening at the start to its close at the end.

`open_ledger`: checked against the checkpoint resumed from, then opened (a crash's torn last line cut).
`LedgerFeed`: lines batched on the event loop, appended on the I/O thread and fsynced on a cadence.
`ThreadMarkers`: where a marker put by another thread (the replicator's outage and catch-up) goes, which changes as
the process ends, and the ledger's close. The file itself (`.loss.json`: its format, writer and reader) is
andrea/rundir/ledger.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from andrea.control.parallel import ranks, sharing
from andrea.control.parallel.distributed import World
from andrea.control.run import resume
from andrea.rundir import checksum, incidents, names
from andrea.rundir.ledger import LossLedger, marker

log = logging.getLogger("andrea.control.run")


class LedgerFeed:
    """The training loop's side of the ledger: lines collect in `lines` on the event loop and go to the I/O
    thread (`io`, FIFO: an append queued before a checkpoint's commit lands before it) at most every FLUSH_S
    seconds or every MAX_LINES lines, fsynced at least every FSYNC_S. A failed append is logged and its lines
    stay in the ledger's backlog, retried first by the next one. `on_flush(lines)` sees every batch handed over
    (the views and the notices, control/observe/notify.py `chain`); `clock` is injectable so the cadence is
    testable without sleeping. `lines` may start with what was recorded before the feed existed (the start's
    markers)."""

    FLUSH_S, FSYNC_S, MAX_LINES = 1.0, 5.0, 512

    def __init__(self, ledger: LossLedger, io: Executor, *, lines: list[dict[str, Any]] | None = None,
                 on_flush: Callable[[list[dict[str, Any]]], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.ledger, self.io, self.clock, self.on_flush = ledger, io, clock, on_flush
        self.lines: list[dict[str, Any]] = lines if lines is not None else []
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


class ThreadMarkers:
    """The ledger's end, and where a marker put by another thread goes until then (`to_ledger` makes the
    `put(kind, detail)` the replicator is built with: its outage and catch-up markers, at the step the run is at):
        "loop"    the event loop's feed: the marker joins the ledger's lines there and goes out at once, fsynced
                  (and so to the feed's `on_flush`: the views and the notices);
        "direct"  the stop's wait for the replica (`direct()`): the event loop is blocked in that wait and the I/O
                  thread is done, so the putting thread appends and fsyncs it itself;
        "closed"  the ledger is closed (`close()` closes it): the log line is the record.
    Built when the ledger opens, so that its `close` is the ledger's; the route is changed and used under one
    lock, so a direct append finishes before the ledger closes."""

    def __init__(self, ledger: LossLedger):
        self.ledger, self.route, self._lock = ledger, "loop", threading.Lock()

    def to_ledger(self, loop: asyncio.AbstractEventLoop, feed: LedgerFeed,
                  step: Callable[[], int]) -> Callable[[str, dict], None]:
        """`put(kind, detail)` for another thread, the marker at `step()` and through `feed` on `loop`."""
        def on_loop(kind: str, detail: dict) -> None:
            feed.lines.append(marker(kind, step(), **detail))
            feed.flush(force_sync=True)

        def put(kind: str, detail: dict) -> None:
            with self._lock:
                route = self.route
                if route == "direct":  # the stop waits for the replica (a replica_back then is the record's end)
                    line = marker(kind, step(), **detail)
                    self.ledger.append([line])
                    self.ledger.sync()
                    if feed.on_flush is not None:
                        feed.on_flush([line])
                    return
            try:
                if route == "loop":
                    loop.call_soon_threadsafe(on_loop, kind, detail)
                    return
            except RuntimeError:  # the loop has ended
                pass
            log.info("%s after the run's end: not in the ledger (%s)", kind, detail)
        return put

    def direct(self) -> None:
        with self._lock:
            self.route = "direct"

    def close(self) -> None:
        """The ledger fsynced and closed: from here a marker from a thread is only a log line."""
        with self._lock:
            self.route = "closed"
            self.ledger.close()


def open_ledger(run_dir: Path, info, held: ExitStack, *, world: World, accept_gap: bool,
                skipped: list[str]) -> tuple[LossLedger | ranks.FollowerLedger, ThreadMarkers, list[dict[str, Any]]]:
    """The ledger at the start, checked first against what the checkpoint resumed from (`info`) recorded of it
    (by rank 0; a refusal leaves the file as it found it and is raised on every rank), then opened (a crash's torn
    last line is cut; the other ranks' appends are dropped), its close registered on `held`. The check's markers (`cut_tail`, `gap`) are
    durable before any other reader (W&B's backfill) reads the file; the lines returned (the incidents of a resume
    below the newest checkpoint, `skipped` saying why) go out through the feed built later."""
    leader = world.leader

    def check() -> tuple[list[dict[str, Any]], list]:  # rank 0's: the other ranks wait for its verdict
        repairs = resume.check_ledger(run_dir, info, accept_gap)
        return repairs, resume.set_aside_newer(run_dir, info) if info is not None else []
    repairs, moved = sharing.leader_only(world, check) or ([], [])
    ledger = (LossLedger if leader else ranks.FollowerLedger)(run_dir / names.LEDGER_NAME)
    if leader and ledger.run is None and info is not None:
        # the id the checkpoint vouches for when no start marker could be read: the checkpoints from here on still
        # name their run, and its replica still knows it (campaign seed 201: after a `restore` it was refused)
        ledger.run = checksum.run_vouched_by(info.path)
    ends = ThreadMarkers(ledger)
    held.callback(ends.close)
    if ledger.torn_bytes:
        log.warning("%s: cut a torn last line of %d bytes left by a crash", names.LEDGER_NAME, ledger.torn_bytes)
    if repairs:
        ledger.append(repairs)
        ledger.sync()
    # checkpoints quarantined, a resume below the newest: incidents on the record (rundir/incidents.py)
    return ledger, ends, incidents.resume_markers(info.step, skipped, moved, names.QUARANTINE_DIR) if moved else []
