"""The run's held-out history (andrea/control/run/heldout.py): seeded from the ledger's effective evals, recorded and
cut back at a rollback, read by other threads without a lock."""

from __future__ import annotations

import json
import math

from andrea.control.run.heldout import HeldOut, eval_losses
from andrea.rundir.ledger import marker


def ev(step, loss):
    return {"event": "eval", "step": step, "val_loss": loss, "time": 0.0}


def test_the_seed_is_the_effective_timeline_up_to_the_start():
    lines = [{"event": "start", "step": 0}, ev(10, 3.0), ev(20, 2.8), ev(30, 2.9),
             {"event": "rollback", "step": 20, "from": 30},  # the eval of 30 belongs to an abandoned timeline
             ev(30, 2.6), ev(40, 2.5), {"event": "resume", "step": 30}]  # 40 ran after the checkpoint of 30
    assert eval_losses(lines, upto=30) == {10: 3.0, 20: 2.8, 30: 2.6}
    assert eval_losses(lines, upto=20) == {10: 3.0, 20: 2.8}


def test_seeded_reads_only_the_markers_and_skips_what_it_cannot_read(tmp_path):
    path = tmp_path / ".loss.json"
    lines = [marker("start", 0), {"step": 1, "loss": 9.0}, ev(10, 3.0), ev(20, 2.5)]
    path.write_bytes(b"".join(json.dumps(e).encode() + b"\n" for e in lines) + b'{"event": "eval", "st\n'
                     + json.dumps(ev(30, 1.0)).encode())  # a junk line, and a torn last line without its \n
    h = HeldOut.seeded(path, upto=100)
    assert dict(h.losses()) == {10: 3.0, 20: 2.5}
    assert dict(HeldOut.seeded(tmp_path / "none", 5).losses()) == {}


def test_record_cut_and_best():
    h = HeldOut({10: 3.0})
    h.record(20, 2.5)
    h.record(30, float("nan"))
    h.record(40, 2.7)
    assert h.best() == (20, 2.5) and h.evals_since_best() == 2
    before = h.losses()
    h.cut(20)  # a rollback to 20
    assert dict(h.losses()) == {10: 3.0, 20: 2.5} and h.evals_since_best() == 0
    assert 40 in before  # a reader's mapping is never changed under it
    h.record(30, 2.4)
    assert h.best() == (30, 2.4)
    assert HeldOut().best() is None and math.isnan(HeldOut({5: float("nan")}).losses()[5])
