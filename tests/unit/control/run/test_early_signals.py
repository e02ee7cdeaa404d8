"""control/run/early_signals.py: the one recorder of signals that arrive while a process starts."""

from __future__ import annotations

import signal

from andrea.control.run import early_signals
from andrea.control.run.early_signals import EarlySignals
from andrea.control.run.signals import HANDLED


def keep_handlers(signals):
    previous = {s: signal.getsignal(s) for s in signals}
    return lambda: [signal.signal(s, h) for s, h in previous.items()]


def test_signals_before_the_handlers_are_recorded_in_order_and_nothing_else_happens():
    restore = keep_handlers(HANDLED)
    try:
        early = EarlySignals(HANDLED)
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGTERM)
    finally:
        restore()
    assert early.received == [signal.SIGUSR1, signal.SIGTERM]


def test_the_process_recorder_gives_its_first_signal_once():
    restore = keep_handlers(early_signals.AT_START)
    try:
        early_signals.install()
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)
        assert early_signals.take() == "SIGINT"
        assert early_signals.take() is None  # taken: a later command in this process is not stopped by it
        early_signals.release()  # nothing installed any more: no handler changed, nothing raised again
    finally:
        restore()
