"""The guard's file side at a start (control/guard/rollback.py): a companion whose known-good checkpoint is not in the run
directory (a restore from a replica that no longer held it) moves the known-good point to the checkpoint resumed
from in one line, keeping the remedy, never a rollback that cannot read its checkpoint. Plain files in a temporary directory, no processes."""

from __future__ import annotations

from pathlib import Path

from andrea.config.keepers import GuardConfig
from andrea.config.schema import RunConfig
from andrea.control.guard import rollback
from andrea.control.guard.decisions import Guard, named_checkpoints
from andrea.rundir import checkpoint as ckpt, names


def state(good: int | None, tentative: list[int], step: int = 30) -> dict:
    g = Guard(GuardConfig(), good_step=good or 0, good_path=names.checkpoint_name(good) if good else None)
    for t in tentative:
        g.on_checkpoint(t, names.checkpoint_name(t))
    return g.to_state(step)


def test_named_checkpoints_are_the_known_good_and_the_tentative_ones_in_the_run_directory():
    assert named_checkpoints(state(10, [20, 30])) == [10, 20, 30]
    assert named_checkpoints(state(None, [20])) == [20]  # the initial state names no checkpoint
    outside = state(10, [])
    outside["good"]["path"] = "/elsewhere/step_000010.bin"  # --init-from's: never the run directory's to fetch
    assert named_checkpoints(outside) == []
    assert named_checkpoints([]) == [] and named_checkpoints({"good": "x", "tentative": 3}) == []


def test_a_missing_known_good_checkpoint_moves_the_pointer_and_keeps_the_trajectorys_remedy(tmp_path):
    info = ckpt.CheckpointInfo(tmp_path / names.checkpoint_name(30), 30, 64)
    saved = state(10, [20, 30])
    # a rollback's remedy in force at step 30: the data and the rate every later step uses (issue 55, hole 2)
    saved["remedy"] = {"attempts": 2, "since": 12, "data_offset": 25, "lr_scale": 0.5}
    rollback.write_companion(tmp_path, 30, saved)
    guard, warning = rollback.load_guard(RunConfig(), info, tmp_path)
    assert guard.good["step"] == 30 and guard.good["path"] == "step_000030.bin"
    assert "step_000010.bin is not in" in warning and "known-good point is now step_000030.bin" in warning
    assert "data offset 25 and lr scale 0.5" in warning and "\n" not in warning
    assert guard.remedy == saved["remedy"] and guard.good["remedy"] == saved["remedy"]
    assert guard.detector.to_state() == saved["detector"] and guard.tentative == []
    (tmp_path / names.checkpoint_name(10)).write_bytes(b"")  # there (validity is the rollback's to check)
    guard, warning = rollback.load_guard(RunConfig(), info, tmp_path)
    assert warning is None and guard.good["step"] == 10 and [t["step"] for t in guard.tentative] == [30]
    (tmp_path / names.checkpoint_name(20)).write_bytes(b"")
    guard, _ = rollback.load_guard(RunConfig(), info, tmp_path, exists=lambda p: Path(p).name != "step_000020.bin")
    assert [t["step"] for t in guard.tentative] == [30]  # what `exists` (rank 0's view) says is gone is dropped
    guard, _ = rollback.load_guard(RunConfig(), info, tmp_path)
    assert [t["step"] for t in guard.tentative] == [20, 30]


def test_a_lost_or_unreadable_companion_keeps_the_ledgers_data_offset_and_lr_scale(tmp_path):
    """The ledger records every rollback's data offset and lr scale: a companion that cannot be read (or is gone)
    leaves the guard without its known-good point, never the run without its trajectory (issue 55, hole 2)."""
    info = ckpt.CheckpointInfo(tmp_path / names.checkpoint_name(30), 30, 64)
    recorded = {"data_offset": 25, "lr_scale": 0.5}
    guard, warning = rollback.load_guard(RunConfig(), info, tmp_path, ledger_remedy=lambda: dict(recorded))
    assert (guard.remedy["data_offset"], guard.remedy["lr_scale"]) == (25, 0.5) and guard.good["step"] == 30
    assert "missing" in warning and "data offset 25 and lr scale 0.5" in warning and "\n" not in warning
    rollback.companion_path(tmp_path, 30).write_text('{"version": 1, "step": 30, "good"')  # torn
    guard, warning = rollback.load_guard(RunConfig(), info, tmp_path, ledger_remedy=lambda: dict(recorded))
    assert (guard.remedy["data_offset"], guard.remedy["lr_scale"]) == (25, 0.5)
    assert "starts afresh from step_000030.bin" in warning and "data offset 25" in warning
    guard, warning = rollback.load_guard(RunConfig(), info, tmp_path)  # no rollback on the record
    assert guard.remedy["data_offset"] == 0 and "data offset 0 and lr scale 1" in warning
    rollback.companion_path(tmp_path, 30).unlink()
    assert rollback.load_guard(RunConfig(), info, tmp_path)[1] is None  # a run from before the guard: silent
