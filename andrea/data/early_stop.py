"""SIGTERM and Ctrl-C recorded from a process's first instant, until `andrea prepare`'s own handlers take over.

Reads and writes nothing. `andrea/__main__.py` calls `install()` before the heavy imports (torch takes a second or
more), so a SIGTERM sent to a just-started `andrea prepare` is a stop like any other (its message, exit 0) rather
than a silent exit 143. Every other command calls `release()` once its arguments are parsed: the default handlers
come back, and a signal received meanwhile is delivered again, ending the process as it always did.
"""

from __future__ import annotations

import signal

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []
_installed = False


def _record(signum: int, frame: object) -> None:
    _received.append(signum)


def install() -> None:
    global _installed
    for sig in SIGNALS:
        signal.signal(sig, _record)
    _installed = True


def take() -> str | None:
    """The name of the first signal received while installed (the caller's handlers are in place by now), once:
    a later call, or one in a process that never installed (a command run in process), gets None."""
    global _installed
    installed, _installed = _installed, False
    received = _received[:1]
    _received.clear()
    return signal.Signals(received[0]).name if installed and received else None


def release() -> None:
    """Default handlers back; a signal received meanwhile is raised again under them."""
    global _installed
    if not _installed:
        return
    _installed = False
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in _received[:1]:
        signal.raise_signal(sig)
