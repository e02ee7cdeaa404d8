"""The step_NNNNNN.bin format, its commit and its validation, without a trainer."""

import os

import numpy as np
import pytest

from andrea.rundir import checkpoint as ckpt, names
from andrea.rundir.checkpoint_write import commit_checkpoint


def payload(n: int, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).standard_normal(3 * n).astype(np.float32)
    data[2 * n:] = np.abs(data[2 * n:])  # v is a second moment
    return data


def test_commit_writes_exact_spec_bytes(tmp_path):
    n = 1001
    data = payload(n)
    path = commit_checkpoint(tmp_path, 42, data)
    raw = path.read_bytes()
    assert path.name == "step_000042.bin"
    assert len(raw) == 8 + 12 * n
    assert np.frombuffer(raw[:8], dtype="<i4").tolist() == [42, n]
    assert np.array_equal(np.frombuffer(raw[8:], dtype="<f4"), data)
    assert not list(tmp_path.glob("*.tmp"))


def test_names_grow_past_six_digits():
    assert names.checkpoint_name(7) == "step_000007.bin"
    assert names.checkpoint_name(1_234_567) == "step_1234567.bin"
    assert names.step_of("step_1234567.bin") == 1_234_567
    assert names.step_of("step_000100.bin.tmp") is None
    assert names.step_of("step_12.bin") is None


@pytest.mark.parametrize("damage, message", [
    (lambda p, n: p.write_bytes(p.read_bytes()[:-5]), "truncated"),
    (lambda p, n: p.write_bytes(p.read_bytes()[:6]), "shorter than the 8-byte header"),
    (lambda p, n: p.write_bytes(b"\0" * (8 + 12 * n)), "not a parameter count"),
    (lambda p, n: p.write_bytes(np.array([41, n], "<i4").tobytes() + p.read_bytes()[8:]), "disagrees with the file name"),
    (lambda p, n: _poke(p, 8 + 4 * 3, np.float32(np.nan)), "weights[3] is not finite"),
    (lambda p, n: _poke(p, 8 + 4 * n + 4, np.float32(np.inf)), "m[1] is not finite"),
    (lambda p, n: _poke(p, 8 + 8 * n, np.float32(-1.0)), "v has negative entries"),
])
def test_validate_names_the_file_and_the_problem(tmp_path, damage, message):
    n = 100
    path = commit_checkpoint(tmp_path, 42, payload(n))
    damage(path, n)
    with pytest.raises(ckpt.CheckpointError) as err:
        ckpt.validate(path, n, deep=True)
    assert str(path) in str(err.value) and message in str(err.value)
    assert "\n" not in str(err.value)


def _poke(path, offset, value):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(np.array([value], "<f4").tobytes())


def test_other_model_is_refused_with_both_counts(tmp_path):
    path = commit_checkpoint(tmp_path, 5, payload(10))
    with pytest.raises(ckpt.CheckpointError, match=r"n_params=10, this model has 11"):
        ckpt.validate(path, 11)


def test_newest_valid_skips_damaged_newer_files(tmp_path):
    n = 50
    commit_checkpoint(tmp_path, 100, payload(n))
    bad = commit_checkpoint(tmp_path, 200, payload(n))
    bad.write_bytes(bad.read_bytes()[:100])
    info, skipped = ckpt.newest_valid(tmp_path, n)
    assert info.step == 100
    assert len(skipped) == 1 and "step_000200.bin" in skipped[0]


def test_failed_commit_leaves_previous_checkpoint_and_no_tmp(tmp_path, monkeypatch):
    n = 64
    good = commit_checkpoint(tmp_path, 100, payload(n))
    before = good.read_bytes()

    def full_disk(fd, data, offset):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full_disk)
    with pytest.raises(OSError):
        commit_checkpoint(tmp_path, 200, payload(n, 1))
    assert good.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000100.bin", "step_000100.sum.json"]


def test_a_fifo_at_a_checkpoints_name_is_refused_not_waited_on(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: `verify step_N.bin` on one used to hang."""
    fifo = tmp_path / names.checkpoint_name(40)
    os.mkfifo(fifo)
    with pytest.raises(ckpt.CheckpointError, match="not a regular file"):
        ckpt.validate(fifo)
