"""The spare (andrea/rundir/spare.py): a checkpoint retention releases is renamed to `spare.ckpt`, and the next commit
renames it onto its `.tmp` and overwrites its blocks; nothing of the old bytes survives, and a file a reader
still has open (descriptor or mapping) is unlinked instead, so the reader keeps its bytes.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from andrea.control.commit.writer import CheckpointWriter
from andrea.rundir import checkpoint as ckpt, names, spare
from andrea.rundir.checkpoint_write import commit_checkpoint
from andrea.rundir.retention import Policy, Retention
from tests.disks import Disk, payload

N = 1001  # 8 + 12n = 12,020 bytes: the O_DIRECT image is padded past the end, then truncated


def reference(tmp_path, step: int) -> bytes:
    """The bytes of `step`'s checkpoint written into a fresh file, in a directory of its own."""
    d = tmp_path / f"reference-{step}"
    d.mkdir()
    return commit_checkpoint(d, step, payload(N, step)).read_bytes()


def commits(run_dir, steps, keep_last=1):
    """Commit `steps` through the trainer's writer (retention keep_last, no major checkpoints)."""
    io = ThreadPoolExecutor(1)
    writer = CheckpointWriter(run_dir, N, torch.device("cpu"), io, retention=Retention(Policy(keep_last, 0)))

    async def go():
        out = []
        for step in steps:
            slot = await writer.free_slot()
            writer.staging[slot].copy_(torch.from_numpy(payload(N, step)))
            out.append(await writer.start_commit(slot, step, None))
        return out

    try:
        results = asyncio.run(go())
    finally:
        io.shutdown()
    assert all(r.error is None for r in results), [r.error for r in results]
    return results


def test_a_released_checkpoint_becomes_the_spare_and_the_next_commit_writes_into_its_blocks(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    commits(run, [10])
    released = (run / "step_000010.bin").stat().st_ino
    commits(run, [20])
    assert (run / names.SPARE_NAME).stat().st_ino == released  # step 10, renamed, not unlinked
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [20]  # the spare is no checkpoint
    disk = Disk(monkeypatch)
    commits(run, [30])
    final = run / "step_000030.bin"
    assert final.stat().st_ino == released, "the commit did not write into the spare"
    assert disk.direct_opens == [str(run / "step_000030.bin.tmp")]  # still O_DIRECT, now over allocated blocks
    assert final.read_bytes() == reference(tmp_path, 30)
    assert not list(run.glob("*.tmp"))


@pytest.mark.parametrize("extra", [5000, -5000])
def test_nothing_of_the_spares_bytes_survives_the_commit(tmp_path, extra):
    """A spare longer than a checkpoint (stale) or shorter (an interrupted commit into a fresh file), full of
    0xFF: the committed file is byte-identical to one written into a fresh file."""
    run = tmp_path / "run"
    run.mkdir()
    (run / names.SPARE_NAME).write_bytes(b"\xff" * (ckpt.checkpoint_bytes(N) + extra))
    commit_checkpoint(run, 40, payload(N, 40))
    assert (run / "step_000040.bin").read_bytes() == reference(tmp_path, 40)
    assert not (run / names.SPARE_NAME).exists()


@pytest.mark.parametrize("kind", ["symlink", "directory"])
def test_a_spare_ckpt_that_is_not_a_regular_file_is_never_written_through(tmp_path, kind):
    """Not a file retention made: the commit writes a new file, and what the name points to is untouched."""
    run, other = tmp_path / "run", tmp_path / "precious.bin"
    run.mkdir()
    other.write_bytes(b"someone else's bytes" * 1000)
    if kind == "symlink":
        (run / names.SPARE_NAME).symlink_to(other)
    else:
        (run / names.SPARE_NAME).mkdir()
    commit_checkpoint(run, 40, payload(N, 40))
    assert (run / "step_000040.bin").read_bytes() == reference(tmp_path, 40)
    assert other.read_bytes() == b"someone else's bytes" * 1000
    assert (run / names.SPARE_NAME).is_symlink() if kind == "symlink" else (run / names.SPARE_NAME).is_dir()


@pytest.mark.parametrize("reader", ["descriptor", "mapping"])
def test_a_checkpoint_a_reader_has_open_is_unlinked_and_the_reader_keeps_its_bytes(tmp_path, reader):
    run = tmp_path / "run"
    run.mkdir()
    commits(run, [10])
    path = run / "step_000010.bin"
    before, ino = path.read_bytes(), path.stat().st_ino
    if reader == "descriptor":
        held = open(path, "rb")  # an rsync or an export, mid-copy
    else:
        held = np.memmap(path, dtype=np.uint8, mode="r")  # its descriptor is closed; the mapping holds the file
    commits(run, [20, 30])  # 20 releases step 10; 30 would have overwritten it, had it been kept
    assert all(p.stat().st_ino != ino for p in run.iterdir()), "a file a reader had open was kept for reuse"
    if reader == "descriptor":
        assert held.read() == before
        held.close()
    else:
        assert bytes(held) == before
        del held
    assert (run / "step_000030.bin").read_bytes() == reference(tmp_path, 30)


def test_a_checkpoint_with_another_name_is_unlinked_and_the_other_name_keeps_its_bytes(tmp_path):
    """`andrea branch` hard-links the checkpoint it starts from into the branch's directory: the trunk's
    retention must never hand that file's blocks to its next commit."""
    run, branch = tmp_path / "run", tmp_path / "branch"
    run.mkdir()
    branch.mkdir()
    commits(run, [10])
    os.link(run / "step_000010.bin", branch / "step_000010.bin")
    before = (branch / "step_000010.bin").read_bytes()
    commits(run, [20, 30])
    assert not (run / names.SPARE_NAME).exists() or (run / names.SPARE_NAME).stat().st_ino != (
        branch / "step_000010.bin").stat().st_ino
    assert (branch / "step_000010.bin").read_bytes() == before
    assert (branch / "step_000010.bin").stat().st_nlink == 1  # only the trunk's name went


def test_a_released_symlink_is_unlinked_and_its_target_never_reused(tmp_path):
    run, archive = tmp_path / "run", tmp_path / "archive"
    run.mkdir()
    archive.mkdir()
    commits(run, [10])
    (run / "step_000010.bin").rename(archive / "step_000010.bin")
    (run / "step_000010.bin").symlink_to(archive / "step_000010.bin")  # an operator's archive, linked back
    before = (archive / "step_000010.bin").read_bytes()
    commits(run, [20])  # releases the link: it goes, and never becomes the spare
    assert not (run / names.SPARE_NAME).is_symlink() and not (run / names.SPARE_NAME).exists()
    commits(run, [30])
    assert (archive / "step_000010.bin").read_bytes() == before


def test_a_filesystem_that_cannot_tell_keeps_no_spare(tmp_path, monkeypatch):
    real = fcntl.fcntl

    def no_leases(fd, cmd, *args):
        if cmd == fcntl.F_SETLEASE:  # NFS and other network filesystems
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, cmd, *args)

    monkeypatch.setattr(spare.fcntl, "fcntl", no_leases)
    run = tmp_path / "run"
    run.mkdir()
    commits(run, [10, 20])
    assert sorted(p.name for p in run.iterdir()) == ["step_000020.bin", "step_000020.sum.json"]  # step 10 unlinked, as without a spare


def test_a_failing_retention_is_logged_and_never_fails_the_commit(tmp_path, monkeypatch, caplog):
    """A checkpoint that landed is committed, whatever happens to the old ones after it (here: retention cannot
    rename them, e.g. files of another user): one log line, and `on_write_error` is not triggered."""
    def refuse(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(spare, "retire", refuse)
    run = tmp_path / "run"
    run.mkdir()
    with caplog.at_level(logging.ERROR, logger="andrea.writer"):
        results = commits(run, [10, 20])  # asserts no commit reports an error
    assert [r.path.name for r in results] == ["step_000010.bin", "step_000020.bin"]
    assert "retention after step_000020.bin failed" in caplog.text
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [10, 20]  # the old one is left: only disk space


def test_keep_last_counts_checkpoints_not_the_spare(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    commits(run, [10, 20, 30, 40], keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [30, 40]
    assert sorted(p.name for p in run.iterdir()) == [names.SPARE_NAME, "step_000030.bin", "step_000030.sum.json",
                                                       "step_000040.bin", "step_000040.sum.json"]
    for step in (30, 40):
        assert (run / names.checkpoint_name(step)).read_bytes() == reference(tmp_path, step)
