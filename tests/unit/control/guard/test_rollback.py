"""The guard's file side at a start (control/guard/rollback.py): a companion whose known-good checkpoint is not in the run
directory (a restore from a replica that no longer held it) moves the known-good point to the oldest tentative
checkpoint still there, else the checkpoint resumed from, in one line, keeping the remedy, never a rollback that cannot read its checkpoint. Plain files in a temporary directory, no processes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

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


def test_a_missing_known_good_checkpoint_moves_the_pointer_to_the_oldest_tentative_one_still_there(tmp_path):
    """Campaign seed 400: the known-good step 10 gone, the tentative 20 (committed, not yet confirmed) on disk, a
    start from 30: the run that kept 10 would confirm 20 first and roll back there, so 20, with the detector and
    the remedy it was committed with, becomes the known-good point, not 30."""
    info = ckpt.CheckpointInfo(tmp_path / names.checkpoint_name(30), 30, 64)
    g = Guard(GuardConfig(), good_step=10, good_path=names.checkpoint_name(10))
    g.on_checkpoint(20, names.checkpoint_name(20))
    at_20 = {"detector": g.detector.to_state(), "remedy": dict(g.remedy)}
    g.remedy = {"attempts": 1, "since": 24, "data_offset": 14, "lr_scale": 1.0}  # a rollback after 20's commit
    g.on_checkpoint(30, names.checkpoint_name(30))
    rollback.write_companion(tmp_path, 30, g.to_state(30))
    (tmp_path / names.checkpoint_name(20)).write_bytes(b"")
    guard, warning = rollback.load_guard(RunConfig(), info, tmp_path)
    assert (guard.good["step"], guard.good["path"]) == (20, "step_000020.bin")
    assert guard.good["detector"] == at_20["detector"] and guard.good["remedy"] == at_20["remedy"]
    assert [t["step"] for t in guard.tentative] == [30] and guard.remedy["data_offset"] == 14  # the trajectory's
    assert "known-good point is now step_000020.bin" in warning and "data offset 14" in warning


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


def test_a_bit_flipped_in_the_companion_is_never_used_the_ledgers_remedy_is(tmp_path):
    """Seed 64 of the campaign (flip@6 of step_N.guard.json): one bit turns the data offset 25 into 27 (the digit
    '5', 0x35, into '7', 0x37): valid JSON and a value every field check accepts. The seal catches it; the guard
    starts afresh with the ledger's offset and scale, said in one line (docs/operating.md: a guard companion
    unreadable), and never reads the data from offset 27."""
    info = ckpt.CheckpointInfo(tmp_path / names.checkpoint_name(30), 30, 64)
    (tmp_path / names.checkpoint_name(10)).write_bytes(b"")
    saved = state(10, [20, 30])
    saved["remedy"] = {"attempts": 1, "since": 12, "data_offset": 25, "lr_scale": 0.5}
    rollback.write_companion(tmp_path, 30, saved)
    guard, warning = rollback.load_guard(RunConfig(), info, tmp_path)
    assert warning is None and guard.remedy == saved["remedy"] and guard.good["step"] == 10  # sealed, read back
    path = rollback.companion_path(tmp_path, 30)
    data = bytearray(path.read_bytes())
    at = data.index(b'"data_offset": 25') + len(b'"data_offset": 2')
    data[at] ^= 0x02  # '5' -> '7'
    path.write_bytes(bytes(data))
    assert json.loads(data)["remedy"]["data_offset"] == 27  # what the old start used, silently
    recorded = {"data_offset": 25, "lr_scale": 0.5}
    guard, warning = rollback.load_guard(RunConfig(), info, tmp_path, ledger_remedy=lambda: dict(recorded))
    assert (guard.remedy["data_offset"], guard.remedy["lr_scale"]) == (25, 0.5) and guard.good["step"] == 30
    assert "does not match its checksum" in warning and "starts afresh from step_000030.bin" in warning
    assert str(path) in warning and "\n" not in warning


def test_a_companion_from_before_the_seal_is_still_read(tmp_path):
    info = ckpt.CheckpointInfo(tmp_path / names.checkpoint_name(30), 30, 64)
    (tmp_path / names.checkpoint_name(10)).write_bytes(b"")
    old = {**state(10, [20, 30]), "version": 1}
    old["remedy"] = {"attempts": 1, "since": 12, "data_offset": 25, "lr_scale": 0.5}
    rollback.companion_path(tmp_path, 30).write_text(json.dumps(old))  # version 1: written without a checksum
    guard, warning = rollback.load_guard(RunConfig(), info, tmp_path)
    assert warning is None and guard.remedy == old["remedy"] and guard.good["step"] == 10
    rollback.companion_path(tmp_path, 30).write_text(json.dumps({**old, "version": 2}))  # a sealed one lost its seal
    guard, warning = rollback.load_guard(RunConfig(), info, tmp_path)
    assert "no 'checksum' field" in warning and guard.good["step"] == 30 and guard.remedy["data_offset"] == 0


def test_a_checkpoint_whose_guard_companion_changed_is_refused_by_every_reader_and_a_start_falls_back(tmp_path):
    """Seed 64 of the campaign: a bit flipped in step_N.guard.json must not steer the run. Each reader of a
    checkpoint (rundir/checkpoint.py: verify, a start, a rollback, export) refuses one whose guard companion's seal
    is broken, as it refuses one whose checksum is, so a start resumes from the next older checkpoint and writes
    the bytes of a run never corrupted. A flip in the digit of the data offset, in the seal's own name, and none."""
    from andrea.rundir.checkpoint_write import commit_checkpoint
    n = 40
    for step in (20, 30):
        commit_checkpoint(tmp_path, step, np.zeros(3 * n, np.float32))
        saved = state(None, [20, 30] if step == 30 else [20], step)
        saved["remedy"] = {"attempts": 1, "since": 12, "data_offset": 25, "lr_scale": 1.0}
        rollback.write_companion(tmp_path, step, saved)
    assert ckpt.newest_valid(tmp_path, n)[0].step == 30  # intact: read back
    path = rollback.companion_path(tmp_path, 30)
    intact = path.read_bytes()
    for needle, bit in ((b'"data_offset": 25', len(b'"data_offset": 2')), (b'"checksum"', 3)):
        data = bytearray(intact)
        data[data.index(needle) + bit] ^= 0x02  # '5' -> '7'; "checksum" -> "chgcksum"
        path.write_bytes(bytes(data))
        json.loads(data)  # still JSON, every value in range: only the seal tells
        info, skipped = ckpt.newest_valid(tmp_path, n)
        assert info.step == 20 and len(skipped) == 1, skipped
        assert "step_000030.bin: its guard companion is damaged" in skipped[0] and "\n" not in skipped[0]
        with pytest.raises(ckpt.CheckpointError, match="guard companion is damaged"):
            ckpt.load(tmp_path / names.checkpoint_name(30), n)
    path.write_bytes(intact)
    assert ckpt.newest_valid(tmp_path, n)[0].step == 30
    old = {**{k: v for k, v in json.loads(intact).items() if k != "checksum"}, "version": 1}
    path.write_text(json.dumps(old))  # unsealed, from before seals: judged
    assert ckpt.newest_valid(tmp_path, n)[0].step == 30                # by load_guard alone, as before
