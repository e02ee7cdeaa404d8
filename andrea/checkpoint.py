"""The checkpoint file `step_NNNNNN.bin`: its format, its atomic commit, its validation and its retention.

Format (SPEC §3, fixed: other tools read it). Five contiguous regions, little-endian, no padding, no metadata:

    offset        type                      content
    0             int32                     step: optimizer updates completed (the header step)
    4             int32                     n_params
    8             float32 × n_params        weights, flat in the model's parameter order (andrea/model.py)
    8 + 4n        float32 × n_params        AdamW first moment m (β1 = 0.9)
    8 + 8n        float32 × n_params        AdamW second moment v (β2 = 0.999)
    total         8 + 12·n bytes

The name is `step_` + the step zero-padded to 6 digits (more digits past 999,999) + `.bin`. The trainer keeps
`[w | m | v]` as one contiguous fp32 buffer, so the payload is that buffer's bytes: one copy, one write.
`write_regions` takes (byte offset, bytes) pieces so a ZeRO-1 rank can write only its slice of each region.

Commit protocol (a checkpoint is trusted only when its commit completed): write `step_NNNNNN.bin.tmp`, fsync
it, rename it onto `step_NNNNNN.bin`, fsync the directory. A crash at any point leaves either the old set of
checkpoints or the old set plus the complete new one; a `.tmp` is never read as a checkpoint and is removed
at the next start.

Validation, cheapest first: the name parses; the size is 8 + 12·n; the header step equals the name's step;
n_params equals the model's; (deep) every float is finite and v ≥ 0.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEADER = struct.Struct("<ii")
NAME_RE = re.compile(r"^step_(\d{6,})\.bin$")
TMP_SUFFIX = ".tmp"
WRITE_CHUNK = 64 << 20  # bytes per write() call: bounded syscalls, lets a slow disk report progress


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line naming the file and the problem."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}.bin"


def step_of(path: str | Path) -> int | None:
    match = NAME_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def checkpoint_bytes(n_params: int) -> int:
    return HEADER.size + 12 * n_params


def header(step: int, n_params: int) -> bytes:
    return HEADER.pack(step, n_params)


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    n_params: int


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every file named like a checkpoint, oldest first (valid or not)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(step_of(p), p) for p in run_dir.iterdir()]
    return sorted((s, p) for s, p in found if s is not None)


def validate(path: str | Path, n_params: int | None = None, *, deep: bool = False) -> CheckpointInfo:
    """Check a checkpoint without trusting it; raise CheckpointError with one line on the first problem."""
    path = Path(path)
    name_step = step_of(path)
    if name_step is None:
        raise CheckpointError(f"{path}: not a checkpoint name (expected step_NNNNNN.bin)")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(HEADER.size)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    if len(head) < HEADER.size:
        raise CheckpointError(f"{path}: truncated: {size} bytes, shorter than the 8-byte header")
    step, n = HEADER.unpack(head)
    if n <= 0:
        raise CheckpointError(f"{path}: header n_params={n} is not a parameter count (file of {size} bytes)")
    if size != checkpoint_bytes(n):
        raise CheckpointError(f"{path}: truncated or padded: {size} bytes, expected {checkpoint_bytes(n)} "
                              f"for n_params={n}")
    if step != name_step:
        raise CheckpointError(f"{path}: header step {step} disagrees with the file name (step {name_step})")
    if n_params is not None and n != n_params:
        raise CheckpointError(f"{path}: checkpoint of another model: n_params={n}, this model has {n_params}")
    if deep:
        _check_values(path, n)
    return CheckpointInfo(path, step, n)


def _check_values(path: Path, n: int) -> None:
    data = np.memmap(path, dtype="<f4", mode="r", offset=HEADER.size, shape=(3, n))
    for region, name in enumerate(("weights", "m", "v")):
        for lo in range(0, n, WRITE_CHUNK // 4):
            chunk = data[region, lo:lo + WRITE_CHUNK // 4]
            if not np.isfinite(chunk).all():
                bad = lo + int(np.argmin(np.isfinite(chunk)))
                raise CheckpointError(f"{path}: {name}[{bad}] is not finite ({chunk[bad - lo]})")
            if name == "v" and (chunk < 0).any():
                raise CheckpointError(f"{path}: v has negative entries (a second moment is never negative)")


def read_payload(path: str | Path, n_params: int) -> tuple[int, np.ndarray]:
    """Validated (deep) read: (step, float32 array of 3·n_params = [w | m | v])."""
    info = validate(path, n_params, deep=True)
    payload = np.fromfile(path, dtype="<f4", offset=HEADER.size, count=3 * n_params)
    return info.step, payload


def newest_valid(run_dir: str | Path, n_params: int) -> tuple[CheckpointInfo | None, list[str]]:
    """The newest checkpoint that passes deep validation, and one line per newer file that was skipped."""
    skipped = []
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            return validate(path, n_params, deep=True), skipped
        except CheckpointError as e:
            skipped.append(str(e))
    return None, skipped


def fsync_dir(directory: str | Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_regions(path: str | Path, regions: Iterable[tuple[int, memoryview | bytes]], size: int) -> None:
    """Write pieces at byte offsets into `path` (created, sized to `size`) and fsync it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        for offset, data in regions:
            view = memoryview(data).cast("B")
            for lo in range(0, len(view), WRITE_CHUNK):
                chunk = view[lo:lo + WRITE_CHUNK]
                written = 0
                while written < len(chunk):
                    written += os.pwrite(fd, chunk[written:], offset + lo + written)
        os.fsync(fd)
    finally:
        os.close(fd)


def commit_checkpoint(run_dir: str | Path, step: int, payload: np.ndarray | memoryview,
                      before_rename: Callable[[], None] | None = None) -> Path:
    """Durably write `step_NNNNNN.bin` from the float32 payload [w | m | v] (length 3·n).

    `before_rename` runs when the temporary file is complete and fsynced (the fault suite's hook).
    On any error the temporary file is removed and the exception propagates; existing checkpoints are untouched.
    """
    view = memoryview(payload).cast("B")
    n = len(view) // 12
    if len(view) != 12 * n:
        raise ValueError(f"payload of {len(view)} bytes is not three float32 regions")
    run_dir = Path(run_dir)
    final = run_dir / checkpoint_name(step)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    try:
        write_regions(tmp, [(0, header(step, n)), (HEADER.size, view)], checkpoint_bytes(n))
        if before_rename is not None:
            before_rename()
        os.rename(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(run_dir)
    return final


def remove_stale_tmp(run_dir: str | Path) -> list[Path]:
    """Delete leftovers of interrupted atomic writes (checkpoints, sidecars, token files); return them.

    Every file andrea writes atomically goes through `<name>.tmp`, and none is ever read: all are garbage.
    """
    run_dir = Path(run_dir)
    stale = sorted(run_dir.glob(f"*{TMP_SUFFIX}")) + sorted(run_dir.glob(f"data/*{TMP_SUFFIX}"))
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def retention_victims(steps: Iterable[int], keep_last: int, keep_every: int) -> list[int]:
    """Steps to delete: all but the newest `keep_last`, sparing multiples of `keep_every` (major checkpoints)."""
    ordered = sorted(set(steps))
    recent = set(ordered[-keep_last:]) if keep_last > 0 else set()
    return [s for s in ordered if s not in recent and not (keep_every and s % keep_every == 0)]
