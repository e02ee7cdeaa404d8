"""What a checkpoint vouches for of the loss ledger, read back and checked.

The run's id (the newest `start` marker's), the hash of the file's first bytes, its newest step entry; and the check
at a start (or a restore) that the ledger still holds the bytes a checkpoint's seal recorded. The seal itself is
written by `LossLedger.seal` (rundir/ledger.py), whose docstring is the format. Reads only.
"""

from __future__ import annotations

import json
import os
import stat
from functools import lru_cache
from pathlib import Path
from typing import Any

import xxhash

from andrea.rundir import regular


def run_id(path: Path) -> str | None:
    """The run's id: the `run` of the newest `start` marker in the ledger at `path`; None when it has none (a run
    started before ids were recorded), or when the file is absent or no regular file (never opened: a FIFO would
    block). Cached per (path, size, mtime): a reader checking many checkpoints reads the file once."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _run_id(str(path), st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None


@lru_cache(maxsize=8)
def _run_id(path: str, size: int, mtime_ns: int) -> str | None:
    try:
        with open(path, "rb") as f:
            data = f.read(size)
    except OSError:
        return None
    found, at = None, data.find(b'"start"')
    while at >= 0:  # only the lines that can be start markers are parsed
        lo, hi = data.rfind(b"\n", 0, at) + 1, data.find(b"\n", at)
        if hi < 0:
            break  # a torn last line: no marker
        try:
            e = json.loads(data[lo:hi])
        except ValueError:
            e = None
        if isinstance(e, dict) and e.get("event") == "start":
            found = e.get("run") if isinstance(e.get("run"), str) else None
        at = data.find(b'"start"', hi)
    return found


def prefix_digest(path: Path, size: int) -> str:
    """The xxh3-128 of the first `size` bytes of `path` (fewer if it is shorter)."""
    h, left = xxhash.xxh3_128(), size
    with regular.open_file(path) as f:
        while left and (piece := f.read(min(left, 1 << 20))):
            h.update(piece)
            left -= len(piece)
    return h.hexdigest()


def ledger_problem(path: Path, recorded: dict[str, Any], checkpoint: str) -> str | None:
    """Why the ledger at `path` is not the one `checkpoint` vouched for (its seal), in one line; None when
    it holds those bytes unchanged (anything after them is the previous process's tail: superseded)."""
    try:
        with regular.open_file(path) as f:
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        size = 0
    want = recorded["bytes"]
    if size < want:
        return (f"{path}: cut short: {size:,} bytes (last step {tail_step(path)}), but {checkpoint} "
                f"was committed on {want:,} bytes ending at step {recorded['last_step']}")
    if prefix_digest(path, want) != recorded["xxh3_128"]:
        return (f"{path}: changed inside the history {checkpoint} vouches for (its first {want:,} bytes, through "
                f"step {recorded['last_step']}, are not the ones it recorded: an edit, garbage or a stale copy)")
    return None


def tail_step(path: Path) -> int | None:
    """The step of the newest complete step entry, read from the file's tail (64 KiB) only."""
    if not path.exists():
        return None
    with regular.open_file(path) as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - (64 << 10)))
        lines = f.read().split(b"\n")[:-1]  # the part after the last "\n" is incomplete
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and "event" not in entry and isinstance(entry.get("step"), int):
            return entry["step"]
    return None
