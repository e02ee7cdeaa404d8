"""control/run/start_deadline.py: a stop signalled during a start that never settles ends the process after its
grace, with one line naming where the main thread is blocked; a start that settles is never ended by it."""

from __future__ import annotations

import signal
import threading
import time

from andrea.control.run.start_deadline import StartDeadline, blocked_where, overdue


def test_a_stop_is_overdue_only_once_signalled_unsettled_and_past_its_grace():
    assert not overdue(None, 100.0, False, 5.0)  # no stop asked for: a slow start is no one's business
    assert not overdue(90.0, 94.9, False, 5.0)
    assert overdue(90.0, 95.0, False, 5.0)
    assert not overdue(90.0, 1e9, True, 5.0)  # settled: the loop honours it


class Exits:
    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


def test_an_unsettled_start_is_ended_with_128_plus_the_signal_after_its_grace(capfd):
    exits = Exits()
    deadline = StartDeadline(0.3, exit=exits)
    t0 = time.monotonic()
    deadline.arm(signal.SIGTERM)
    deadline.arm(signal.SIGINT)  # the first stop's clock is the one that runs
    assert exits.called.wait(10)
    assert exits.codes == [128 + signal.SIGTERM] and 0.3 <= time.monotonic() - t0 < 5
    err = capfd.readouterr().err
    assert err.startswith("andrea: SIGTERM received 0.3 s ago and the start is still blocked (at ") and \
        err.count("\n") == 1, err


def test_a_start_that_settles_in_time_is_never_ended():
    exits = Exits()
    deadline = StartDeadline(0.3, exit=exits)
    deadline.arm(signal.SIGTERM)
    deadline.settled()
    assert not exits.called.wait(1.0)
    quiet = StartDeadline(0.1, exit=exits)  # no stop asked for: nothing to bound
    assert not exits.called.wait(0.5) and quiet.signalled_at is None


def test_where_the_main_thread_is_blocked_is_named_by_file_line_and_function():
    """Read from another thread while the main thread waits in a join: its innermost frame is threading's wait."""
    seen: list[str] = []
    t = threading.Thread(target=lambda: (time.sleep(0.2), seen.append(blocked_where(threading.main_thread().ident))))
    t.start()
    t.join()
    assert len(seen) == 1 and "threading.py:" in seen[0] and " in " in seen[0], seen
    assert blocked_where(None) == "an unknown place"


def test_chained_handlers_start_the_clock_call_the_loops_own_and_are_undone_when_the_start_settles():
    """The event loop's Python-level handler only wakes the loop (a loop blocked in the start never reads it):
    `chain` puts `arm` in front of it while the start lasts, and `settled` puts the loop's own back."""
    import os
    calls: list[int] = []
    loops_own = lambda signum, frame: calls.append(signum)  # noqa: E731
    previous = signal.signal(signal.SIGUSR2, loops_own)
    try:
        deadline = StartDeadline(300.0, exit=Exits())
        deadline.chain([signal.SIGUSR2])
        os.kill(os.getpid(), signal.SIGUSR2)
        assert calls == [signal.SIGUSR2] and deadline.signum == signal.SIGUSR2 and deadline.signalled_at is not None
        deadline.settled()
        assert signal.getsignal(signal.SIGUSR2) is loops_own
    finally:
        signal.signal(signal.SIGUSR2, previous)
