""".loss.json: append-only lines, torn tails, failed appends, and the effective history."""

import os

import pytest

from andrea.control import ledger as L


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
