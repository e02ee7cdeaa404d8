"""Signals that arrive while a process starts, before its own handlers are armed: recorded, never acted on.

One recorder, two uses. `andrea/__main__.py` calls `install()` first thing, before the heavy imports (torch takes a
second or more): SIGTERM and Ctrl-C are recorded from the process's first instant. `andrea prepare` then `take()`s
the first one once its own handlers are in place (a stop like any other: its message, exit 0, rather than a silent
exit 143); every other command calls `release()` once its arguments are parsed (the default handlers come back,
and a signal received meanwhile is delivered again, ending the process as it always did). `train` then records
with its own `EarlySignals(HANDLED)` (SIGTERM, SIGINT, SIGUSR1, SIGHUP) until the runtime's loop has taken over
and replays them (control/run/runtime.py), so a SIGTERM during imports or data preparation ends in the same clean stop as
one during training; its recorder starts the clock of a StartDeadline (control/run/start_deadline.py), so a start
blocked where no record is ever read still ends in bounded time. Reads and writes nothing; imports only `signal`,
so installing it costs the start nothing.
"""

from __future__ import annotations

import signal

AT_START = (signal.SIGTERM, signal.SIGINT)  # what __main__ records from the first instant


class EarlySignals:
    """Plain `signal.signal` handlers for `signals` that only record, in order of arrival."""

    def __init__(self, signals=AT_START, deadline=None) -> None:
        self.signals = tuple(signals)
        self.received: list[signal.Signals] = []
        self.deadline = deadline  # a StartDeadline (control/run/start_deadline.py): a stop's clock, or None
        for sig in self.signals:
            signal.signal(sig, self._record)

    def _record(self, signum: int, frame: object) -> None:
        self.received.append(signal.Signals(signum))
        if self.deadline is not None and signum in AT_START:
            self.deadline.arm(signum)


_at_start: EarlySignals | None = None  # the process's recorder, from install() until take() or release()


def install() -> None:
    global _at_start
    _at_start = EarlySignals(AT_START)


def take() -> str | None:
    """The name of the first signal received since `install()` (the caller's handlers are in place by now), once:
    a later call, or one in a process that never installed (a command run in process), gets None."""
    global _at_start
    recorder, _at_start = _at_start, None
    return recorder.received[0].name if recorder is not None and recorder.received else None


def release() -> None:
    """Default handlers back; a signal received meanwhile is raised again under them."""
    global _at_start
    recorder, _at_start = _at_start, None
    if recorder is None:
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in recorder.received[:1]:
        signal.raise_signal(sig)
