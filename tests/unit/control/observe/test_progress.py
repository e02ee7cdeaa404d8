"""control/observe/progress.py: the three reporters' shared parts (the ETA in words; a log line at most every LOG_SECONDS
without a terminal) and the lines they log."""

from __future__ import annotations

import logging

from andrea.control.observe import progress
from andrea.control.observe.progress import ByteProgress, CountProgress, Progress


def test_eta_is_hours_minutes_seconds_then_days_and_zero_without_a_rate():
    assert progress.eta(90, 1.0) == "00:01:30"
    assert progress.eta(3 * 86400, 1.0) == "3.0d"
    assert progress.eta(100, 0.0) == "00:00:00"


def test_without_a_terminal_each_reporter_logs_lines_with_an_eta(caplog, monkeypatch):
    clock = iter(range(0, 10_000, 7))  # seconds: each reading 7 s after the one before
    monkeypatch.setattr(progress.time, "monotonic", lambda: float(next(clock)))
    caplog.set_level(logging.INFO, logger="andrea.control.observe.progress")
    steps = Progress(0, 100, 1_000, log_every=10)
    for step in range(1, 21):
        steps.update(step, 2.0, 1e-3)
    data = ByteProgress(10_000_000, "prepare")
    data.advance(0, 0)
    data.advance(5_000_000, 123)
    count = CountProgress(40, "eval", "examples")
    count(10)
    count(10)
    for reporter in (steps, data, count):
        assert reporter.bar is None  # pytest's stderr is not a terminal
        reporter.close()
    lines = [r.getMessage() for r in caplog.records]
    # the first line at the first step (not 10 steps later), then every log_every
    assert [line.split(" loss")[0] for line in lines if line.startswith("step ")] == ["step 1/100", "step 10/100",
                                                                                     "step 20/100"]
    [timed] = [line for line in lines if line.startswith("timed: ")]  # once, after the first steps are timed
    assert timed.startswith("timed: 7 s/step over steps 2-11; step 100 in 00:10:23 (")
    assert any(line.startswith("prepare: 5.0 of 10.0 MB (50 %)") and " eta 00:00:" in line for line in lines)
    assert any(line.startswith("eval: 20 of 40 examples (50 %)") and " eta 00:00:" in line for line in lines)
