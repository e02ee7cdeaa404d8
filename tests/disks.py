"""Test helpers at the os-call seam of a checkpoint commit: a payload, and a Disk that spies on and breaks O_DIRECT;
and a real filesystem filled to its last byte (tests/faults/test_full_disk.py, bench/chaos.py).

A refusal is injected as EINVAL from `os.open` when the flags carry O_DIRECT, or from `os.pwrite` on a descriptor
whose flags (read back with fcntl) carry O_DIRECT, so the tests see what the real file descriptor was opened with,
not what the code meant.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import numpy as np
import pytest


def payload(n: int, seed: int = 0) -> np.ndarray:
    data = np.random.default_rng(seed).standard_normal(3 * n).astype(np.float32)
    data[2 * n:] = np.abs(data[2 * n:])
    return data


def is_direct(fd: int) -> bool:
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


class Disk:
    """Spies on (and optionally breaks) the O_DIRECT calls of a commit, through os.open / os.pwrite."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, refuse_open: bool = False, refuse_write: int | None = None,
                 full_after: int | None = None, max_write: int | None = None):
        self.real_open, self.real_pwrite = os.open, os.pwrite
        self.refuse_open, self.refuse_write, self.full_after, self.max_write = (refuse_open, refuse_write,
                                                                                full_after, max_write)
        self.direct_opens: list[str] = []
        self.direct_writes: list[tuple[int, int]] = []  # (offset, length) that reached the file with O_DIRECT
        monkeypatch.setattr(os, "open", self.open)
        monkeypatch.setattr(os, "pwrite", self.pwrite)

    def open(self, path, flags, mode=0o777, *args, **kwargs):
        if flags & os.O_DIRECT:
            if self.refuse_open:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))
            self.direct_opens.append(str(path))
        return self.real_open(path, flags, mode, *args, **kwargs)

    def pwrite(self, fd, data, offset):
        if not is_direct(fd):
            return self.real_pwrite(fd, data, offset)
        if self.refuse_write is not None:  # an errno: EINVAL (the filesystem) or EFAULT (unpinnable memory)
            raise OSError(self.refuse_write, os.strerror(self.refuse_write))
        data = memoryview(data)
        if self.full_after is not None and offset + len(data) > self.full_after:
            room = self.full_after - offset
            if room <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            data = data[:room]  # a short write up to the last free block, then ENOSPC
        if self.max_write is not None:
            data = data[:self.max_write]
        written = self.real_pwrite(fd, data, offset)
        self.direct_writes.append((offset, written))
        return written


def refusal_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "refuses O_DIRECT" in r.getMessage()]


def refuse_o_direct_on_setfl(monkeypatch: pytest.MonkeyPatch, module) -> None:
    """`module.fcntl.fcntl` refuses F_SETFL with O_DIRECT (EINVAL): a filesystem that refuses it on an open fd."""
    real = module.fcntl.fcntl

    def refuse(fd, cmd, *args):
        if cmd == module.fcntl.F_SETFL and args and args[0] & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, cmd, *args)

    monkeypatch.setattr(module.fcntl, "fcntl", refuse)


def fill_to_the_last_byte(directory: Path) -> Path:
    """Write a filler file until the filesystem is completely full (down to the last byte). Bounded: at most
    the filesystem's size in writes of each chunk size, then it fails instead of writing forever."""
    filler = directory / "filler"
    st = os.statvfs(directory)
    size = st.f_blocks * st.f_frsize
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for chunk in (1 << 20, 1 << 12, 1):
            for _ in range(size // chunk + 2):  # a filesystem of `size` bytes refuses one of these writes
                try:
                    os.write(fd, bytes(chunk))
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
            else:
                raise AssertionError(f"{directory}: still not full after {size} bytes in chunks of {chunk}")
    finally:
        os.close(fd)
    return filler
