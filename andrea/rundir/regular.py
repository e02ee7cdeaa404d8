"""A run file opened only when it is a regular file: the one way every reader (and appender) of a run's files opens
them, so that a FIFO, a directory, a socket or a device where a run file belongs is refused in one line naming it,
never waited on.

Why: `open()` of a FIFO for reading waits in the kernel for a writer, for good, and a Python signal handler that
only records (control/run/early_signals.py) lets the call resume: a `mkfifo step_000040.sum.json` hung `train`,
`status`, `verify` and `export` with SIGTERM absorbed.

How, race-free: the file is opened with O_NONBLOCK (a FIFO's open then returns at once; a socket's and a
writer-less FIFO's write open fail with ENXIO at once), then `fstat` of that very descriptor decides. A check by
name first (`lstat`, then `open`) would leave a window in which the name is swapped for a FIFO between the two;
the descriptor cannot change what it refers to. O_NONBLOCK is cleared again before the file is handed on (a
regular file ignores it anyway). Following a symbolic link is allowed: what counts is the file it ends at.

Reads and writes nothing of its own; `NotRegularFile` is an OSError (every reader's `except OSError` sees it) and a
UserError (the command line prints its one line, exit 1).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO

from andrea.errors import UserError

KINDS = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISDIR, "a directory"), (stat.S_ISSOCK, "a socket"),
         (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


class NotRegularFile(UserError, OSError):
    """A run file's name holds something that is not a regular file; the message names it and what it is."""

    def __init__(self, path: str | Path, kind: str) -> None:
        super().__init__(errno.EINVAL, f"{kind}, not a regular file")
        self.path, self.kind = str(path), kind

    def __str__(self) -> str:
        return f"{self.path}: is {self.kind}, not a regular file: nothing read from it; remove or rename it"


def kind_of(mode: int) -> str | None:
    """What a file of `mode` (st_mode) is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in KINDS if test(mode)), "not a regular file")


def open_fd(path: str | Path, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """`os.open(path, flags, mode)` of a regular file only (module docstring): the descriptor, blocking as usual;
    NotRegularFile for anything else, FileNotFoundError (and other OSErrors) as `os.open` raises them."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno in (errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP):  # a socket, a reader-less FIFO, a directory
            try:
                what = kind_of(os.stat(path).st_mode)
            except OSError:
                what = None
            if what is not None:
                raise NotRegularFile(path, what) from None
        raise
    try:
        what = kind_of(os.fstat(fd).st_mode)
        if what is not None:
            raise NotRegularFile(path, what)
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: str | Path, mode: str = "rb") -> BinaryIO:
    """A binary file object of `path` ("rb" or "rb+"), a regular file only (`open_fd`)."""
    flags = {"rb": os.O_RDONLY, "rb+": os.O_RDWR, "r+b": os.O_RDWR}[mode]
    return os.fdopen(open_fd(path, flags), mode)


def read_bytes(path: str | Path) -> bytes:
    """Every byte of the regular file at `path` (`Path.read_bytes`, refusing what is not one)."""
    with open_file(path) as f:
        return f.read()


def read_text(path: str | Path) -> str:
    """`read_bytes` decoded as UTF-8 (UnicodeDecodeError as `Path.read_text` raises it)."""
    return read_bytes(path).decode("utf-8")
