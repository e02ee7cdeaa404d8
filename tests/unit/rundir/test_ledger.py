""".loss.json: append-only lines, torn tails, failed appends, and the effective history."""

import os

import pytest

from andrea.control.run.ledger_feed import LedgerFeed
from andrea.rundir import ledger as L


def entry(step, loss=1.0):
    return {"step": step, "loss": loss}


def test_appends_are_lines_and_reopening_only_appends(tmp_path):
    path = tmp_path / ".loss.json"
    led = L.LossLedger(path)
    led.append([entry(1), entry(2)])
    led.close()
    first = path.read_bytes()
    led = L.LossLedger(path)
    led.append([L.marker("resume", 1), entry(2, 0.5)])
    led.close()
    assert path.read_bytes().startswith(first)
    contents = L.read_ledger(path)
    assert not contents.torn_tail
    assert [e["loss"] for e in L.history(contents.entries)] == [1.0, 0.5]  # the resume superseded step 2


def test_a_torn_tail_is_cut_at_open_and_recorded(tmp_path):
    path = tmp_path / ".loss.json"
    path.write_bytes(b'{"step":1,"loss":1.0}\n{"step":2,"lo')
    assert L.read_ledger(path).torn_tail
    led = L.LossLedger(path)
    led.append([entry(2)])
    led.close()
    lines = path.read_text().splitlines()
    assert lines[0] == '{"step":1,"loss":1.0}' and '"torn_tail"' in lines[1] and '"bytes":13' in lines[1]
    assert [e["step"] for e in L.history(L.read_ledger(path).entries)] == [1, 2]


def test_a_torn_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / ".loss.json"
    path.write_bytes(b'{"step":1,"loss":1.0}\n{"step":2,"lo\n{"step":3,"loss":1.0}\n')
    with pytest.raises(L.LedgerError, match="line 2"):
        L.read_ledger(path)


def test_a_failed_append_rolls_back_and_is_retried(tmp_path, monkeypatch):
    path = tmp_path / ".loss.json"
    led = L.LossLedger(path)
    led.append([entry(1)])
    real_write = os.write
    calls = {"n": 0}

    def half_then_full(fd, data):
        calls["n"] += 1
        if calls["n"] == 1:
            return real_write(fd, bytes(data[:7]))  # a partial write, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError):
        led.append([entry(2), entry(3)])
    assert path.read_text() == '{"step":1,"loss":1.0}\n'  # rolled back: no torn line
    assert led.backlog == 2
    with pytest.raises(OSError):
        led.sync()  # a checkpoint must not commit ahead of these lines
    monkeypatch.setattr(os, "write", real_write)
    led.append([entry(4)])
    led.close()
    assert [e["step"] for e in L.read_ledger(path).entries] == [1, 2, 3, 4]


def test_ema_is_bias_corrected():
    assert L.ema([2.0])[0] == pytest.approx(2.0)
    values = L.ema([2.0] * 50 + [1.0] * 50)
    assert values[49] == pytest.approx(2.0) and 1.0 < values[-1] < 2.0


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Inline:
    """An executor that runs each task at submit (the I/O thread's FIFO order, without a thread)."""

    def submit(self, fn, *args):
        from concurrent.futures import Future
        fut = Future()
        fut.set_result(fn(*args))
        return fut


class SpyLedger:
    def __init__(self):
        self.path, self.backlog, self.appended, self.syncs = ".loss.json", 0, [], 0

    def append(self, lines):
        self.appended.append([e["step"] for e in lines])

    def sync(self):
        self.syncs += 1


def test_the_feed_hands_lines_over_at_its_cadence_and_fsyncs_at_its_own():
    clock, led, seen = Clock(), SpyLedger(), []
    feed = LedgerFeed(led, Inline(), on_flush=lambda lines: seen.append(len(lines)), clock=clock)
    feed.lines.append(entry(1))
    feed.flush()
    assert led.appended == [] and feed.lines  # not due: the lines wait on the event loop
    clock.now = LedgerFeed.FLUSH_S
    feed.flush()
    assert led.appended == [[1]] and led.syncs == 0 and seen == [1] and not feed.lines
    feed.lines += [entry(s) for s in range(2, 2 + LedgerFeed.MAX_LINES)]
    feed.flush()  # not due by time, due by count
    assert len(led.appended) == 2 and led.syncs == 0
    clock.now = LedgerFeed.FSYNC_S
    feed.lines.append(entry(600))
    feed.flush()
    assert led.appended[-1] == [600] and led.syncs == 1
    feed.flush(force_sync=True)  # a checkpoint: fsynced now, even with nothing new
    assert led.appended[-1] == [] and led.syncs == 2


def test_a_failed_append_through_the_feed_is_logged_and_its_lines_stay_in_the_backlog(tmp_path, monkeypatch,
                                                                                      caplog):
    led = L.LossLedger(tmp_path / ".loss.json")
    feed = LedgerFeed(led, Inline(), clock=Clock())
    real_write = os.write

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    feed.lines += [entry(1), entry(2)]
    feed.flush(force_sync=True)
    assert led.backlog == 2 and "append failed, 2 lines kept to retry" in caplog.text
    monkeypatch.setattr(os, "write", real_write)
    feed.lines.append(entry(3))
    feed.flush(force_sync=True)
    feed.wait()
    led.close()
    assert [e["step"] for e in L.read_ledger(tmp_path / ".loss.json").entries] == [1, 2, 3]
