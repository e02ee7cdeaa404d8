"""The ledger at a start (control/run/resume.py `check_ledger`): it never holds a line no reader can read, and no
checkpoint vouches for one. Synthetic run directories (a ledger and a checkpoint's ledger record), no processes."""

from __future__ import annotations

import json
import logging

import pytest

from andrea.control.replica.admit import run_record
from andrea.control.run import resume
from andrea.rundir import checkpoint as ckpt, ledger as L, names
from tests.runs import andrea_records


def entry(step: int) -> dict:
    return {"step": step, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 8 * step, "time": 5.0, "phase": 0}


def run_with_checkpoint(tmp_path, steps: int = 20, at: int = 10):
    """A ledger of `steps` step entries whose checkpoint at step `at` vouches for the first `at`."""
    path = tmp_path / names.LEDGER_NAME
    led = L.LossLedger(path)
    led.append([{**L.marker("start", 0, identity={"train.seed": 1}), "time": 5.0}])
    led.append([entry(s) for s in range(1, at + 1)])
    led.sync()
    names.companion_path(tmp_path, at, "ledger").write_bytes(led.record_bytes())
    led.append([entry(s) for s in range(at + 1, steps + 1)])  # the previous process's tail
    led.close()
    return path, ckpt.CheckpointInfo(tmp_path / names.checkpoint_name(at), at, 64)


def wandb_backfill(run_dir):
    """W&B's view as a start opens it (control/observe/wandb_log.py): it reads the whole ledger at once (the SDK left out)."""
    import sys
    from unittest import mock

    from andrea.config.outputs import LogConfig
    from andrea.control.observe.wandb_log import WandbLog
    with mock.patch.dict(sys.modules, {"wandb": None}):
        WandbLog(LogConfig(wandb=True, wandb_mode="offline"), run_dir, {}, log_every=10).close(0)


def test_the_first_unreadable_line_of_a_tail_is_where_it_is_cut():
    assert L.unreadable_tail(b'{"step":1}\n{"step":2}\n') is None
    assert L.unreadable_tail(b'{"step":1}\njunk\n{"step":3}\n') == len(b'{"step":1}\n')
    assert L.unreadable_tail(b"\0\0\0\n") == 0 and L.unreadable_tail(b'[1]\n') == 0
    assert L.unreadable_tail(b'{"step":1}\n{"st') is None  # a torn last line is LossLedger's to cut


@pytest.mark.parametrize("junk", [b"junk\n", b"\0" * 40 + b"\n", b'{"step": 21}\n\xff\xfe\n{"step": 22}\n'])
def test_junk_after_what_the_checkpoint_vouches_for_is_cut_kept_and_said_once(tmp_path, caplog, junk):
    path, info = run_with_checkpoint(tmp_path)
    good = path.read_bytes()
    with open(path, "ab") as f:
        f.write(junk)
    with caplog.at_level(logging.WARNING, "andrea.control.run"):
        [cut] = resume.check_ledger(tmp_path, info, accept_gap=False)
    kept = good + junk[:junk.index(b"\n") + 1] if junk.startswith(b'{"step": 21}') else good
    assert path.read_bytes() == kept and cut["event"] == "cut_tail" and cut["at"] == len(kept)
    assert (tmp_path / cut["kept"]).read_bytes() == (good + junk)[len(kept):]  # evidence, never deleted
    assert len(andrea_records(caplog)) == 1 and "\n" not in caplog.text.strip()
    led = L.LossLedger(path)
    led.append([cut])
    led.close()
    assert [e["step"] for e in L.history(L.read_ledger(path).entries)][-1] >= 20  # every reader reads it


def test_junk_a_checkpoint_vouches_for_is_refused_untouched_then_accepted_with_a_gap_every_reader_honours(
        tmp_path):
    path, _ = run_with_checkpoint(tmp_path, steps=10, at=10)
    with open(path, "ab") as f:  # what the old start kept: junk, then a checkpoint that vouched for it
        f.write(b"junk\n" + json.dumps(entry(11)).encode() + b"\n")
    led = L.LossLedger(path)
    names.companion_path(tmp_path, 11, "ledger").write_bytes(led.record_bytes())
    led.close()
    info, before = ckpt.CheckpointInfo(tmp_path / names.checkpoint_name(11), 11, 64), path.read_bytes()
    with pytest.raises(L.LedgerError, match="line 12 .* vouches for it.*--accept-ledger-gap"):
        resume.check_ledger(tmp_path, info, accept_gap=False)
    with pytest.raises(L.LedgerError):
        wandb_backfill(tmp_path)
    assert path.read_bytes() == before
    assert run_record(tmp_path)["started"] == 5.0  # the replica's owner check reads past it: not "another run"
    [gap] = resume.check_ledger(tmp_path, info, accept_gap=True)
    assert gap["event"] == "gap" and gap["unreadable_lines"] == [12] and path.read_bytes() == before
    led = L.LossLedger(path)
    led.append([gap])
    led.close()
    assert L.read_ledger(path).entries[-1]["event"] == "gap"  # status, plot, compare
    wandb_backfill(tmp_path)  # what a start with log.wandb reads once the gap marker is durable (control/run/runtime.py)
    assert resume.check_ledger(tmp_path, info, accept_gap=False) == []  # and the next start is clean


def test_a_start_without_a_checkpoint_refuses_unlisted_junk_too(tmp_path):
    path = tmp_path / names.LEDGER_NAME
    path.write_bytes(b'{"event":"start","step":0,"time":1}\n\0\0\n{"step":1,"loss":1.0}\n')
    with pytest.raises(L.LedgerError, match="line 2"):
        resume.check_ledger(tmp_path, None, accept_gap=False)
    [gap] = resume.check_ledger(tmp_path, None, accept_gap=True)
    assert gap["unreadable_lines"] == [2] and gap["step"] == 0
    (tmp_path / "other").mkdir()
    assert resume.check_ledger(tmp_path / "other", None, accept_gap=False) == []  # a fresh run: no ledger yet
