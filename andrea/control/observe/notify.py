"""Notices to the operator (`[notify]`): the events they act on, as JSON, to a command and/or an HTTP URL.

Sending never blocks a step and never fails the run: `Notifier.send` puts the event on a bounded queue that the
`andrea-notify` thread empties; a command or POST that fails or outlasts notify.timeout_s is one warning line, and
the next notice still goes. How each is sent, bounded in time (the whole exchange), in captured bytes and in the
processes it leaves (none): control/observe/delivery.py.
`admit` (the rate limit) and `event` (the format) are plain functions, tested with an injected clock.

The event, one JSON object (UTF-8), the same on a command's stdin and as the POST body:
    {"event": "rollback", "step": 40, "time": 1764430000.12, "run_dir": "/runs/120m", "host": "gpu7",
     "pid": 4242, "rank": 0, "message": "guard: rolled back from step 40 to step_000020.bin", ...detail}
    event       a kind of andrea/notices.py's registry (docs/operating.md's table of notices: when each is sent,
                its detail); a ledger marker's notice carries the marker's fields (rundir/markers.py)
    step        the header step at the event;  time  Unix time;  rank  the torchrun rank (rank 0 sends all but
                stall, which the hung rank sends)
    suppressed  (only when > 0) notices of this kind the rate limit dropped since the last one sent
A new kind is a row of andrea/notices.py, sent with `Notifier.send(kind, step, message=..., **detail)` (or, for
a ledger marker, a message in rundir/markers.py: `lines` sends it as the marker reaches the I/O thread).
Reads notify.command and notify.url; writes nothing to the run directory.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shlex
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from andrea.config.check import ConfigError
from andrea.config.keepers import NotifyConfig
from andrea.control.observe import delivery
from andrea.notices import NOTICE_KINDS
from andrea.rundir.markers import notice_message

log = logging.getLogger("andrea.notify")

HOUR = 3600.0
LAST_WORDS = tuple(k.name for k in NOTICE_KINDS.values() if k.last_word)  # a process's last: never rate-limited
QUEUE_SIZE = 64


def admit(sent: list[float], now: float, per_hour: int, kind: str) -> bool:
    """Whether a notice of `kind` may go out at `now`, given the times the earlier ones of its kind were sent."""
    return kind in LAST_WORDS or sum(1 for t in sent if now - t < HOUR) < per_hour


def event(kind: str, step: int, *, run_dir: Path, rank: int, now: float, message: str,
          suppressed: int = 0, **detail: Any) -> dict[str, Any]:
    """The notice's JSON object (the format above)."""
    out = {"event": kind, "step": step, "time": round(now, 3), "run_dir": str(run_dir), "host": socket.gethostname(),
           "pid": os.getpid(), "rank": rank, "message": message, **detail}
    if suppressed:
        out["suppressed"] = suppressed
    return out


def from_marker(line: dict[str, Any]) -> tuple[str, str] | None:
    """A ledger marker the operator acts on, as (kind, message); None for every other line."""
    message = notice_message(line)
    return None if message is None else (line["event"], message)


def check(cfg: NotifyConfig) -> None:
    """The command's program exists (refused before the run starts: one line naming the key, exit 2)."""
    argv = shlex.split(cfg.command)
    if argv and shutil.which(argv[0]) is None:
        raise ConfigError(f"notify.command={cfg.command!r}: no program {argv[0]!r} found")


class Notifier:
    """The sender: `send` from any thread (never blocks), delivery on the `andrea-notify` thread."""

    def __init__(self, cfg: NotifyConfig, run_dir: Path, rank: int = 0, clock: Callable[[], float] = time.time):
        self.cfg, self.run_dir, self.rank, self.clock = cfg, run_dir.resolve(), rank, clock
        self.argv = shlex.split(cfg.command)
        self.enabled = bool(self.argv or cfg.url)
        self.sent: dict[str, list[float]] = {}
        self.suppressed: dict[str, int] = {}
        self._q: queue.Queue = queue.Queue(QUEUE_SIZE)
        self._pending: list[str] = []  # the kinds queued or being delivered, oldest first (what close may leave)
        self._lock = threading.Lock()  # send() is called from the event loop and from the watchdog's thread
        self._thread = threading.Thread(target=self._run, name="andrea-notify", daemon=True)
        if self.enabled:
            self._thread.start()

    def send(self, kind: str, step: int, *, message: str, **detail: Any) -> None:
        if not self.enabled or not self.cfg.sends(kind) or (self.rank != 0 and not NOTICE_KINDS[kind].any_rank):
            return
        with self._lock:
            now = self.clock()
            sent = [t for t in self.sent.get(kind, []) if now - t < HOUR]
            if not admit(sent, now, self.cfg.max_per_hour, kind):
                self.suppressed[kind] = self.suppressed.get(kind, 0) + 1
                return
            self.sent[kind] = sent + [now]
            doc = event(kind, step, run_dir=self.run_dir, rank=self.rank, now=now, message=message,
                        suppressed=self.suppressed.pop(kind, 0), **detail)
        try:
            with self._lock:
                self._q.put_nowait(doc)
                self._pending.append(kind)
        except queue.Full:
            log.warning("notify: %d notices waiting; dropped the %s notice of step %d", QUEUE_SIZE, kind, step)

    def lines(self, lines: list[dict[str, Any]]) -> None:
        """The ledger lines handed to the I/O thread (LedgerFeed.on_flush): the markers that are notices."""
        for line in lines:
            found = from_marker(line)
            if found is not None:
                detail = {k: v for k, v in line.items() if k not in ("event", "step", "time")}
                self.send(found[0], line["step"], message=found[1], **detail)

    def close(self, timeout: float) -> None:
        """Deliver what is queued, waiting at most `timeout` seconds; what is still queued or being delivered then
        is one warning line naming each notice (then the daemon thread is left behind: the process is exiting)."""
        if not (self.enabled and self._thread.is_alive()):
            return
        deadline = time.monotonic() + timeout
        try:
            self._q.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            left = list(self._pending)
        if left:
            log.warning("notify: %d notice%s not delivered before exit (%s): still %s after %g s; dropped",
                        len(left), "" if len(left) == 1 else "s", ", ".join(left),
                        "being sent or queued", timeout)

    def _run(self) -> None:
        while (doc := self._q.get()) is not None:
            body = json.dumps(doc).encode()
            if self.argv:
                self._command(body, doc["event"])
            if self.cfg.url:
                self._post(body, doc["event"])
            with self._lock:
                self._pending.remove(doc["event"])

    def _command(self, body: bytes, kind: str) -> None:
        try:
            r = delivery.run_command(self.argv, body, self.cfg.timeout_s)
        except delivery.Expired:
            log.warning("notify.command: the %s notice took longer than %g s; abandoned (its process group ended)",
                        kind, self.cfg.timeout_s)
        except OSError as e:
            log.warning("notify.command: the %s notice failed: %s", kind, e)
        else:
            if r.returncode != 0:
                tail = r.stderr_tail.decode(errors="replace").strip().splitlines()[-1:] or [""]
                log.warning("notify.command: the %s notice exited %d %s", kind, r.returncode, tail[0][:200])

    def _post(self, body: bytes, kind: str) -> None:
        try:
            status = delivery.post(self.cfg.url, body, self.cfg.timeout_s,
                                   {"Content-Type": "application/json", "User-Agent": "andrea"})
        except delivery.Expired:
            log.warning("notify.url: the %s notice took longer than %g s (the whole exchange); abandoned", kind,
                        self.cfg.timeout_s)
        except Exception as e:  # noqa: BLE001  (refused, reset, TLS: a notice is never the run's)
            log.warning("notify.url: the %s notice was not delivered: %s", kind, e)
        else:
            if status >= 400:
                log.warning("notify.url: the %s notice was not delivered: HTTP %d", kind, status)


def chain(*handlers: Callable[[list], None] | None) -> Callable[[list], None] | None:
    """One LedgerFeed.on_flush that calls each of `handlers` (None skipped)."""
    live = [h for h in handlers if h is not None]
    if not live:
        return None

    def on_flush(lines: list) -> None:
        for h in live:
            h(lines)
    return on_flush
