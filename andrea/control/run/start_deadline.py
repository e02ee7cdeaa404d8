"""A stop asked for while the process starts is honoured in bounded time, even when the start is blocked.

A signal handler only records (control/run/early_signals.py, control/run/runtime.py's `on_signal`), and the start
acts on the record when it reaches a point that can: the step loop's first boundary, or the data preparation's
next chunk. A start blocked in a system call that never returns (a FIFO or a hung network disk under a file the
start reads, a peer that never answers) would never get there: SIGTERM recorded, and the process alive for good.

`StartDeadline` bounds that: `arm(signum)` (state only: a handler may call it) starts the clock at the first stop
signal, from the early recorder's handler, the runtime's `on_signal`, or (`chain`) in front of the event loop's
own Python-level handler, which runs even while the loop's thread is blocked in the start; `settled()` says the
start is over (the loop honours stops from here, the watchdog watches it). A daemon
thread waits for the one or the other: when `grace_s` passes between them, it writes one line to stderr naming
the signal and where the main thread is blocked, and ends the process with 128 + the signal's number (a shell's
"killed by SIGTERM"), as the default handler would have. Nothing has been trained when it fires, so nothing is lost
that a clean stop would have kept; an atomic write cut short leaves only its `.tmp`, which the next start removes.

`overdue` is the decision, a plain function. Reads and writes nothing else.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

GRACE_S = 20.0  # a healthy start reaches its stop point within seconds of a stop signal (preparation: ~1 s)


def overdue(signalled_at: float | None, now: float, settled: bool, grace_s: float) -> bool:
    """Whether a stop signalled at `signalled_at` (monotonic; None: none yet) has waited past `grace_s` for a
    start that has not `settled`."""
    return signalled_at is not None and not settled and now - signalled_at >= grace_s


def blocked_where(thread_id: int | None) -> str:
    """`file:line in function` of the innermost frame of thread `thread_id` (the main thread's: the blocked call)."""
    frame = sys._current_frames().get(thread_id) if thread_id is not None else None
    if frame is None:
        return "an unknown place"
    code = frame.f_code
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}"


class StartDeadline:
    """The clock from the first stop signal to the start's end; see the module docstring."""

    def __init__(self, grace_s: float = GRACE_S, exit=os._exit) -> None:
        self.grace_s, self._exit = grace_s, exit
        self.signum: int | None = None
        self.signalled_at: float | None = None
        self._wake = threading.Event()  # set by arm() and by settled()
        self._settled = False
        self._chained: dict = {}  # signal -> the handler `chain` wrapped
        self._main = threading.main_thread().ident
        threading.Thread(target=self._watch, name="andrea-start-deadline", daemon=True).start()

    def arm(self, signum: int) -> None:
        """A stop signal arrived (SIGTERM, SIGINT): the first one starts the clock. Sets state only."""
        if self.signalled_at is None:
            self.signum, self.signalled_at = int(signum), time.monotonic()
            self._wake.set()

    def settled(self) -> None:
        """The start is over: a stop is the loop's from here. The watcher ends; `chain`'s handlers are undone."""
        self._settled = True
        self._wake.set()
        for sig, previous in self._chained.items():
            signal.signal(sig, previous)
        self._chained = {}

    def chain(self, signals) -> None:
        """From the main thread: run `arm` before the Python-level handler now installed for each of `signals`
        (asyncio's or uvloop's, which only wakes the event loop: a loop blocked in a call of the start never reads
        it), until `settled`. The loop's own wake-up (its wakeup fd) is untouched."""
        for sig in signals:
            previous = signal.getsignal(sig)

            def handler(signum: int, frame, previous=previous) -> None:
                self.arm(signum)
                if callable(previous):
                    previous(signum, frame)
            self._chained[sig] = previous
            signal.signal(sig, handler)

    def _watch(self) -> None:
        self._wake.wait()
        if self._settled:
            return
        left = self.signalled_at + self.grace_s - time.monotonic()
        while not self._settled and left > 0:
            self._wake.clear()
            self._wake.wait(left)
            left = self.signalled_at + self.grace_s - time.monotonic()
        if not overdue(self.signalled_at, time.monotonic(), self._settled, self.grace_s):
            return
        name = signal.Signals(self.signum).name
        sys.stderr.write(f"andrea: {name} received {self.grace_s:g} s ago and the start is still blocked (at "
                         f"{blocked_where(self._main)}): exiting {128 + self.signum} without a clean stop; nothing was "
                         "trained yet\n")
        sys.stderr.flush()
        self._exit(128 + self.signum)
