"""O_DIRECT checkpoint writes: the same bytes as buffered writes, no padding left, refusals fall back once, ENOSPC
stays clean.

The seam is the os calls the commit makes (the one the fault suite wraps too): a refusal is injected as EINVAL
from `os.open` when the flags carry O_DIRECT, or from `os.pwrite` on a descriptor whose flags (read back with
fcntl) carry O_DIRECT, so the tests see what the real file descriptor was opened with, not what the code meant.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from andrea.control.commit.writer import CheckpointWriter, staging_image
from andrea.rundir import checkpoint as ckpt, names
from andrea.rundir.checkpoint_write import (DIRECT_ALIGN, DirectIO, commit_checkpoint, image_bytes, publish_checkpoint,
                                            write_regions)
from andrea.rundir.retention import Policy, Retention
from tests.disks import Disk, payload, refusal_lines

# 8 + 12n: 12,020 bytes (padded to 12,288 for the O_DIRECT write), and 8,192 bytes exactly (no padding at all)
SIZES = [1001, 682]


@pytest.mark.parametrize("n", SIZES)
def test_o_direct_writes_exactly_the_bytes_of_the_buffered_path_and_truncates_the_padding(tmp_path, monkeypatch, n):
    data = payload(n)
    (tmp_path / "buffered").mkdir()
    (tmp_path / "direct").mkdir()
    buffered = commit_checkpoint(tmp_path / "buffered", 7, data, direct=DirectIO(False))
    disk = Disk(monkeypatch)
    direct = DirectIO()
    path = commit_checkpoint(tmp_path / "direct", 7, data, direct=direct)
    assert direct.enabled and direct.refusal is None
    assert disk.direct_opens == [str(path) + names.TMP_SUFFIX], "the .tmp was not opened with O_DIRECT"
    assert sum(length for _, length in disk.direct_writes) == image_bytes(n)
    assert all(off % DIRECT_ALIGN == 0 and length % DIRECT_ALIGN == 0 for off, length in disk.direct_writes)
    assert path.stat().st_size == 8 + 12 * n, "the O_DIRECT padding was left in the file"
    assert path.read_bytes() == buffered.read_bytes()
    assert np.array_equal(np.frombuffer(path.read_bytes()[8:], dtype="<f4"), data)
    assert not list((tmp_path / "direct").glob("*.tmp"))


def test_short_o_direct_writes_are_continued_to_the_end(tmp_path, monkeypatch):
    n = 5000
    disk = Disk(monkeypatch, max_write=3 * DIRECT_ALIGN)  # the kernel may stop a DIO write at any block
    path = commit_checkpoint(tmp_path, 3, payload(n), direct=DirectIO())
    assert len(disk.direct_writes) == -(-image_bytes(n) // (3 * DIRECT_ALIGN))
    assert np.array_equal(ckpt.read_payload(path, n)[1], payload(n))


def test_the_writer_stages_the_snapshot_at_byte_8_of_an_aligned_image_and_commits_it_with_o_direct(tmp_path,
                                                                                                  monkeypatch):
    n = 1001
    image = staging_image(n, pinned=False)
    assert image.data_ptr() % DIRECT_ALIGN == 0 and image.numel() == image_bytes(n)
    disk = Disk(monkeypatch)
    io = ThreadPoolExecutor(1)

    async def commit(direct: bool, run_dir: Path):
        writer = CheckpointWriter(run_dir, n, torch.device("cpu"), io, retention=Retention(Policy(5, 0)), direct=direct)
        writer.staging[1].copy_(torch.from_numpy(payload(n)))  # what Trainer.snapshot does on CPU
        assert writer.staging[1].data_ptr() == writer.images[1].data_ptr() + 8
        return writer, await writer.start_commit(1, 40, None)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    writer, result = asyncio.run(commit(True, tmp_path / "a"))
    assert result.error is None and result.direct and result.cpu_seconds >= 0.0
    assert writer.images[1].data_ptr() % DIRECT_ALIGN == 0
    assert disk.direct_opens == [str(tmp_path / "a" / "step_000040.bin.tmp")]
    _, buffered = asyncio.run(commit(False, tmp_path / "b"))
    io.shutdown()
    assert not buffered.direct and len(disk.direct_opens) == 1, "direct=False still used O_DIRECT"
    assert result.path.read_bytes() == buffered.path.read_bytes()
    assert result.path.stat().st_size == ckpt.checkpoint_bytes(n)


@pytest.mark.parametrize("where, code", [("open", errno.EINVAL), ("first write", errno.EINVAL),
                                         ("first write", errno.EFAULT)])
def test_a_filesystem_refusing_o_direct_falls_back_to_buffered_with_one_log_line(tmp_path, monkeypatch, caplog,
                                                                                 where, code):
    n = 1001
    expected = commit_checkpoint(tmp_path, 10, payload(n, 10), direct=DirectIO(False)).read_bytes()
    (tmp_path / "step_000010.bin").unlink()
    Disk(monkeypatch, refuse_open=where == "open", refuse_write=code if where == "first write" else None)
    direct = DirectIO()
    with caplog.at_level(logging.INFO, logger="andrea.checkpoint"):
        for step in (10, 20, 30):  # one writer, three commits: the refusal is said once
            commit_checkpoint(tmp_path, step, payload(n, step), direct=direct)
    lines = refusal_lines(caplog)
    assert len(lines) == 1, lines
    assert str(tmp_path) in lines[0] and f"{where}: {os.strerror(code)}" in lines[0] and "buffered" in lines[0]
    assert not direct.enabled and direct.refusal == lines[0]
    assert (tmp_path / "step_000010.bin").read_bytes() == expected
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [10, 20, 30]
    assert all(p.stat().st_size == 8 + 12 * n for _, p in ckpt.list_checkpoints(tmp_path))
    assert not list(tmp_path.glob("*.tmp"))


def test_a_real_tmpfs_gets_the_same_bytes_and_at_most_one_log_line(tmp_path, caplog):
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        pytest.skip("no writable /dev/shm (tmpfs) here")
    n = 1001
    reference = commit_checkpoint(tmp_path, 5, payload(n), direct=DirectIO(False)).read_bytes()
    run = shm / f"andrea-test-direct-{os.getpid()}"
    run.mkdir()
    try:
        direct = DirectIO()
        with caplog.at_level(logging.INFO, logger="andrea.checkpoint"):
            commit_checkpoint(run, 5, payload(n), direct=direct)
            commit_checkpoint(run, 6, payload(n, 6), direct=direct)
        # tmpfs takes O_DIRECT since Linux 6.6 and refuses it before: either way the bytes are the format's
        assert len(refusal_lines(caplog)) == (0 if direct.enabled else 1), refusal_lines(caplog)
        assert (run / "step_000005.bin").read_bytes() == reference
        assert ckpt.validate(run / "step_000006.bin", n, deep=True).step == 6
    finally:
        for p in run.iterdir():
            p.unlink()
        run.rmdir()


def test_enospc_on_the_o_direct_path_removes_the_tmp_keeps_older_checkpoints_and_the_next_cadence_commits(
        tmp_path, monkeypatch, caplog):
    n = 1001
    old = commit_checkpoint(tmp_path, 10, payload(n, 10))
    old_bytes = old.read_bytes()
    disk = Disk(monkeypatch, full_after=2 * DIRECT_ALIGN)  # the disk fills two blocks into the new file
    io = ThreadPoolExecutor(1)
    writer = CheckpointWriter(tmp_path, n, torch.device("cpu"), io, retention=Retention(Policy(5, 0)))

    async def commit(step: int):
        writer.staging[step // 10 % 2].copy_(torch.from_numpy(payload(n, step)))
        return await writer.start_commit(step // 10 % 2, step, None)

    with caplog.at_level(logging.INFO, logger="andrea"):
        failed = asyncio.run(commit(20))
        assert failed.error and "step_000020.bin" in failed.error and os.strerror(errno.ENOSPC) in failed.error
        assert disk.direct_writes == [(0, 2 * DIRECT_ALIGN)], "the failure was not on the O_DIRECT path"
        assert writer.direct.enabled, "ENOSPC is not a refusal of O_DIRECT: the next commit must try it again"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010.bin", "step_000010.sum.json"], "a half file was left behind"
        assert old.read_bytes() == old_bytes and writer.last_committed is None
        disk.full_after = None  # space freed: the next cadence
        landed = asyncio.run(commit(30))
    io.shutdown()
    assert landed.error is None and landed.direct and writer.last_committed == 30
    assert not refusal_lines(caplog)
    assert np.array_equal(ckpt.read_payload(tmp_path / "step_000030.bin", n)[1], payload(n, 30))
    assert old.read_bytes() == old_bytes


def test_write_regions_then_publish_commits_a_checkpoint_from_slices(tmp_path):
    """The ZeRO-1 path: pieces of w, m and v at their byte offsets (any order) into one .tmp, then the commit point."""
    n = 300
    data = payload(n)
    view = memoryview(data).cast("B")
    tmp = tmp_path / ("step_000050.bin" + names.TMP_SUFFIX)
    cut = 4 * (n // 3)  # two slices per region, second halves first
    pieces = [(8 + r * 4 * n + cut, view[r * 4 * n + cut:(r + 1) * 4 * n]) for r in range(3)]
    pieces += [(8 + r * 4 * n, view[r * 4 * n:r * 4 * n + cut]) for r in range(3)] + [(0, ckpt.header(50, n))]
    write_regions(tmp, pieces, ckpt.checkpoint_bytes(n))
    final = publish_checkpoint(tmp, tmp_path / "step_000050.bin")
    assert not tmp.exists() and final.stat().st_size == 8 + 12 * n
    assert np.array_equal(ckpt.read_payload(final, n)[1], data)


def test_a_failed_publish_removes_the_tmp(tmp_path):
    tmp = tmp_path / ("step_000060.bin" + names.TMP_SUFFIX)
    tmp.write_bytes(b"x")
    with pytest.raises(OSError):
        publish_checkpoint(tmp, tmp_path / "missing-dir" / "step_000060.bin")
    assert not tmp.exists()
