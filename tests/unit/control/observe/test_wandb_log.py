"""The W&B view's record, `.wandb.json` (control/observe/wandb_log.py), as a hostile user leaves it: the wrong shape is one
warning line and never stops a start; a `logged_through` that cannot be true is bounded, and what is said about
it is true. No W&B SDK is needed: the view is built and closed before it would reach W&B."""

from __future__ import annotations

import json
import logging
import sys

import pytest

from andrea.config.outputs import LogConfig
from andrea.control.observe.wandb_log import WandbLog, from_record, rewound_warning
from andrea.rundir.ledger import marker


def entry(step: int) -> dict:
    return {"step": step, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 8 * step, "time": float(step)}


def run_dir(tmp_path, record, steps: int = 0, checkpoint: int | None = None):
    (tmp_path / ".wandb.json").write_text(json.dumps(record))
    lines = [marker("start", 0)] + [entry(s) for s in range(1, steps + 1)]
    (tmp_path / ".loss.json").write_text("".join(json.dumps(e) + "\n" for e in lines))
    if checkpoint is not None:
        (tmp_path / f"step_{checkpoint:06d}.bin").write_bytes(b"")  # named like one: all the bound reads
    return tmp_path


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "andrea.wandb" and r.levelno >= logging.WARNING]


@pytest.mark.parametrize("record, run_id, said", [
    ([], None, 'a JSON list, not the W&B record {"id": ..., "logged_through": STEP}: a new W&B run is started'),
    ({"id": 12345, "logged_through": "sixty"}, None, "id 12345 is no W&B run id: a new W&B run is started"),
    ({"id": "a/b", "logged_through": 3}, None, "id 'a/b' is no W&B run id: a new W&B run is started"),
    ({"id": "ab12cd34", "logged_through": "sixty"}, "ab12cd34",
     "logged_through 'sixty' is no step: W&B run ab12cd34 goes on and is offered every step of the ledger "
     "(it keeps the ones it has)"),
])
def test_a_record_of_the_wrong_shape_is_one_warning_and_the_view_starts(record, run_id, said, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="andrea.wandb"):
        view = WandbLog(LogConfig(wandb=True, wandb_timeout_s=5.0), run_dir(tmp_path, record, steps=3), {}, 10)
        view.close(None)
    assert warnings(caplog) == [f"{tmp_path / '.wandb.json'}: {said}"]
    assert view.id == run_id and view.rows.logged == -1 and sorted(view.rows.rows) == [1, 2, 3]


def test_a_logged_through_past_the_newest_checkpoint_is_bounded_and_nothing_false_is_said(tmp_path, caplog,
                                                                                          monkeypatch):
    """A healthy resume at its newest checkpoint (step 30) with `logged_through` 1,000,000 in the record: one line
    saying so, and no claim that W&B holds steps it cannot hold or that a checkpoint failed verification."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # the SDK absent: its own one line, after the record's
    with caplog.at_level(logging.WARNING, logger="andrea.wandb"):
        view = WandbLog(LogConfig(wandb=True, wandb_timeout_s=5.0),
                        run_dir(tmp_path, {"id": "ab12cd34", "logged_through": 1_000_000}, steps=34, checkpoint=30),
                        {}, 10)
        view.add_records([marker("resume", 30), entry(31)])
        view.settle(31)
        view.close(31)
    said = warnings(caplog)
    assert said[0] == (f"{tmp_path / '.wandb.json'}: logged_through 1000000 is past the run's newest checkpoint, "
                       "step 30 (W&B is only sent steps a checkpoint has settled): taken as 30")
    assert len(said) == 2 and "not installed" in said[1], said


def test_a_start_below_what_wandb_was_sent_says_which_steps_it_will_not_get():
    assert from_record({"id": "ab12cd34", "logged_through": 20}, 25, "w") == ("ab12cd34", 20, None)
    assert rewound_warning(20, 15) == (
        "this start resumed from step 15, below step 20 that W&B was sent (.wandb.json): W&B keeps the steps it "
        "has, and steps 16..20 of this timeline will not reach it (its history only moves forward); the ledger is "
        "the record")
