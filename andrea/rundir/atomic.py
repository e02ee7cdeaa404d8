"""Atomic, durable writes of whole files: temporary file, fsync, rename, directory fsync.

A reader sees the old file or the new one, never half of either; on return the new one survives a power cut.
Used for every small file of a run (sidecars, run.toml, the data manifest, token files' commits), for files
written in pieces (`streamed`: a replica's object brought back by `restore`), and for the last step of the
checkpoint's own commit (rundir/checkpoint_write.py writes its `.tmp` with O_DIRECT, then `publish`es it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from andrea.rundir.names import tmp_path


def fsync_dir(directory: str | Path) -> None:
    """Make a directory's entries (a rename, a new or removed name) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> Path:
    """Rename a complete, fsynced temporary file onto its final name, then fsync the directory: the commit
    point. A failed rename removes the temporary file and propagates."""
    try:
        os.rename(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(final.parent)
    return final


@contextlib.contextmanager
def streamed(path: Path) -> Iterator[BinaryIO]:
    """A file written in pieces and published whole: yields its temporary file; leaving the block fsyncs it and
    `publish`es it onto `path`, an error removes it (nothing at `path` changes)."""
    tmp = tmp_path(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    publish(tmp, path)


def write_atomic(path: Path, data: bytes) -> None:
    """One file: temporary, fsync, rename, directory fsync (write_many of one)."""
    write_many({path: data})


def write_many(files: dict[Path, bytes]) -> None:
    """Atomic writes of several files with one fsync per directory: each temporary file written and fsynced,
    then each renamed, then each directory fsynced once. Every file is still old-or-new, never half;
    on return all are durable (what a checkpoint's companions need before its `.bin` is renamed)."""
    tmps = {path: tmp_path(path) for path in files}
    try:
        for path, data in files.items():
            with open(tmps[path], "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for path, tmp in tmps.items():
            os.rename(tmp, path)
    except BaseException:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)  # a full disk must not also keep half files
        raise
    for directory in {path.parent for path in files}:
        fsync_dir(directory)
