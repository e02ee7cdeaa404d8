"""rundir/atomic.py: write_many makes each file atomic and all of them durable with one directory fsync."""

import json
import os

import pytest

from andrea.rundir import atomic, sidecars


def test_write_many_replaces_every_file_and_fsyncs_the_directory_once(tmp_path, monkeypatch):
    old = {tmp_path / "a.json": b"old a", tmp_path / "b.json": b"old b"}
    for path, data in old.items():
        path.write_bytes(data)
    synced = []
    monkeypatch.setattr(atomic, "fsync_dir", lambda d: synced.append(d))
    atomic.write_many({tmp_path / "a.json": sidecars.json_bytes({"x": 1}), tmp_path / "b.json": b"new b",
                       tmp_path / "c.json": b"new c"})
    assert json.loads((tmp_path / "a.json").read_text()) == {"x": 1}
    assert (tmp_path / "b.json").read_bytes() == b"new b" and (tmp_path / "c.json").read_bytes() == b"new c"
    assert synced == [tmp_path]
    assert not list(tmp_path.glob("*.tmp"))


def test_write_many_that_fails_writing_leaves_every_old_file_and_no_temporary(tmp_path, monkeypatch):
    (tmp_path / "a.json").write_bytes(b"old a")
    real_fsync, calls = os.fsync, []

    def full_disk_on_second(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(atomic.os, "fsync", full_disk_on_second)
    with pytest.raises(OSError, match="No space"):
        atomic.write_many({tmp_path / "a.json": b"new a", tmp_path / "b.json": b"new b"})
    assert (tmp_path / "a.json").read_bytes() == b"old a"  # nothing renamed before every file was durable
    assert not (tmp_path / "b.json").exists()
    assert not list(tmp_path.glob("*.tmp"))
