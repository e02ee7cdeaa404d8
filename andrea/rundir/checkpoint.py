"""The checkpoint file `step_NNNNNN.bin`: its format, its validation and its listing (which ones a run keeps:
rundir/retention.py).

Format (docs/formats.md, fixed: other tools read it). Five contiguous regions, little-endian, no padding, no metadata:

    offset        type                      content
    0             int32                     step: optimizer updates completed (the header step)
    4             int32                     n_params
    8             float32 × n_params        weights, flat in the model's parameter order (andrea/model/gpt.py)
    8 + 4n        float32 × n_params        AdamW first moment m (β1 = 0.9)
    8 + 8n        float32 × n_params        AdamW second moment v (β2 = 0.999)
    total         8 + 12·n bytes

The name is `step_` + the step zero-padded to 6 digits (more digits past 999,999) + `.bin`. The trainer keeps
`[w | m | v]` as one contiguous fp32 buffer, so the payload is that buffer's bytes: one copy, one write.

Commit protocol (a checkpoint is trusted only when its commit completed): write `step_NNNNNN.bin.tmp`, fsync it,
rename it onto `step_NNNNNN.bin`, fsync the directory. A crash at any point leaves either the old set of
checkpoints or the old set plus the complete new one; a `.tmp` is never read as a checkpoint and is removed at the
next start (`remove_stale_tmp`). The write itself, O_DIRECT from a staged image or buffered, and the commit:
rundir/checkpoint_write.py.

Integrity: the image's content checksum (rundir/checksum.py, `step_NNNNNN.sum.json`) is computed on a side
thread while the image is written, and made durable after the `.tmp` and before the rename, so every committed
checkpoint has one. Validation, cheapest first: the name parses; the size is 8 + 12·n; the header step equals the
name's step; n_params equals the model's; (deep) the bytes are the ones the checksum recorded (a checkpoint from
before checksums is unverifiable, not broken), every float is finite and v ≥ 0.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea.errors import UserError
from andrea.rundir import checksum, regular, sidecars
from andrea.rundir.names import DATA_DIR, TMP_SUFFIX, companion_path, is_own_tmp, step_of

HEADER = struct.Struct("<ii")
WRITE_CHUNK = 64 << 20  # bytes per read or write() call: bounded syscalls, lets a slow disk report progress


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be used; the message is one line naming the file and the problem."""


class OtherModelError(CheckpointError):
    """A sound checkpoint of another model than the command configures (`n_params` differs): the configuration's
    to fix (a forgotten `--preset`), not the file's."""


def checkpoint_bytes(n_params: int) -> int:
    return HEADER.size + 12 * n_params


def header(step: int, n_params: int) -> bytes:
    return HEADER.pack(step, n_params)


VERIFIED, UNVERIFIABLE, UNCHECKED = "verified", "unverifiable", "unchecked"


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    step: int
    n_params: int
    checksum: str = UNCHECKED  # VERIFIED against step_NNNNNN.sum.json (deep), UNVERIFIABLE without one


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every file named like a checkpoint, oldest first (valid or not)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(step_of(p), p) for p in run_dir.iterdir()]
    return sorted((s, p) for s, p in found if s is not None and _regular(p))


def foreign_entries(run_dir: str | Path) -> list[Path]:
    """Entries named like a checkpoint that are not regular files (a directory, a link): never listed, read,
    retained or removed; the writer says so once."""
    run_dir = Path(run_dir)
    return sorted(p for p in run_dir.iterdir() if step_of(p) is not None and os.path.lexists(p) and not _regular(p)) \
        if run_dir.is_dir() else []


def _regular(path: Path) -> bool:
    """A regular file (not a directory, link or device someone put at a checkpoint's name: never ours to use
    or to remove). False when it vanished meanwhile (retention)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def validate(path: str | Path, n_params: int | None = None, *, deep: bool = False) -> CheckpointInfo:
    """Check a checkpoint without trusting it; raise CheckpointError with one line on the first problem."""
    path = Path(path)
    name_step = step_of(path)
    if name_step is None:
        raise CheckpointError(f"{path}: not a checkpoint name (expected step_NNNNNN.bin)")
    try:
        with regular.open_file(path) as f:  # a FIFO, a directory, a device: refused, never waited on
            size = os.fstat(f.fileno()).st_size
            head = f.read(HEADER.size)
    except regular.NotRegularFile as e:  # named directly (verify, --init-from): listings never hold one
        raise CheckpointError(str(e)) from None
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
        try:  # another model's only if sound as one (a header edited in place is damage, not a forgotten --preset)
            validate(path, None, deep=True)
        except CheckpointError as e:
            raise CheckpointError(f"{path}: header n_params={n} (this model has {n_params}), and as a checkpoint of "
                                  f"{n} parameters it does not verify: {str(e).removeprefix(f'{path}: ')}") from None
        raise OtherModelError(f"{path}: checkpoint of another model: n_params={n}, this model has {n_params}")
    if not deep:
        return CheckpointInfo(path, step, n)
    recorded = _recorded_checksum(path)  # read first: a checksum that vanishes with its file is no false alarm
    try:
        with regular.open_file(path) as f:
            data = np.memmap(f, dtype=np.uint8, mode="r")
    except regular.NotRegularFile:  # refused as it is: no bad checkpoint to quarantine, the user's to remove
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    return _check_image(path, data, step, n, recorded)


def _recorded_checksum(path: Path) -> dict | None:
    """The checkpoint's `.sum.json`; None for one from before checksums. CheckpointError for one that cannot be
    read, or that is missing or another run's where its companions say it should be this run's
    (checksum.companion_problem), or whose guard companion's seal is broken (rundir/sidecars.py's `seal_problem`):
    unverified, refused like a bad one."""
    try:
        recorded = checksum.read(path)
    except checksum.ChecksumError as e:
        raise CheckpointError(str(e)) from None
    problem = checksum.check_companions(path, recorded)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
    guard = sidecars.seal_problem(companion_path(path.parent, step_of(path), "guard"))
    if guard is not None:  # its data offset and lr scale steer every later step: a changed one is never used
        raise CheckpointError(f"{path}: its guard companion is damaged ({guard}): unverified")
    return recorded


def _check_image(path: Path, image: np.ndarray, step: int, n: int, recorded: dict | None) -> CheckpointInfo:
    """The deep checks over the whole file's bytes (`image`, uint8): checksum, finite values, v >= 0."""
    hasher = checksum.RegionHasher(n) if recorded is not None else None
    if hasher is not None:
        hasher.update(image[:HEADER.size])
    values = image[HEADER.size:HEADER.size + 12 * n].view("<f4").reshape(3, n)
    problem = None
    for region, name in enumerate(("weights", "m", "v")):
        for lo in range(0, n, WRITE_CHUNK // 4):
            chunk = values[region, lo:lo + WRITE_CHUNK // 4]
            if hasher is not None:
                hasher.update(chunk)
            if problem is None and not np.isfinite(chunk).all():
                bad = lo + int(np.argmin(np.isfinite(chunk)))
                problem = f"{name}[{bad}] is not finite ({chunk[bad - lo]})"
            if problem is None and name == "v" and (chunk < 0).any():
                problem = "v has negative entries (a second moment is never negative)"
    changed = checksum.mismatch(recorded, step, n, hasher.digests()) if hasher is not None else None
    if changed is not None or problem is not None:  # a changed byte is named first, then what it made of a value
        raise CheckpointError(f"{path}: {'; '.join(p for p in (changed, problem) if p is not None)}")
    return CheckpointInfo(path, step, n, VERIFIED if recorded is not None else UNVERIFIABLE)


def load(path: str | Path, n_params: int) -> tuple[CheckpointInfo, np.ndarray]:
    """Validated (deep) read: the checkpoint's info and [w | m | v] (float32, 3·n_params), checked against the
    checksum in the memory it is returned in (one read of the file: what was checked is what the caller gets)."""
    path = Path(path)
    info = validate(path, n_params)
    recorded = _recorded_checksum(path)
    try:
        with regular.open_file(path) as f:
            image = np.fromfile(f, dtype=np.uint8)
    except regular.NotRegularFile:  # refused as it is: no bad checkpoint to quarantine, the user's to remove
        raise
    if len(image) != checkpoint_bytes(n_params):
        raise CheckpointError(f"{path}: changed size while it was read ({len(image)} bytes)")
    return _check_image(path, image, info.step, n_params, recorded), image[HEADER.size:].view("<f4")


def read_payload(path: str | Path, n_params: int) -> tuple[int, np.ndarray]:
    """`load`'s (step, [w | m | v])."""
    info, payload = load(path, n_params)
    return info.step, payload


def newest_valid(run_dir: str | Path, n_params: int) -> tuple[CheckpointInfo | None, list[str]]:
    """The newest checkpoint that passes deep validation, and one line per newer file that was skipped."""
    (info, _), skipped = _newest(run_dir, lambda path: (validate(path, n_params, deep=True), None))
    return info, skipped


def newest_loaded(run_dir: str | Path, n_params: int, errors: list[CheckpointError] | None = None
                  ) -> tuple[CheckpointInfo | None, np.ndarray | None, list[str]]:
    """`newest_valid` with the payload it checked (`load`): a start reads its checkpoint once. `errors` receives
    the skipped files' errors themselves (of another model, or damaged: a start's refusal tells them apart)."""
    (info, payload), skipped = _newest(run_dir, lambda path: load(path, n_params), errors)
    return info, payload, skipped


def _newest(run_dir, check, errors: list[CheckpointError] | None = None) -> tuple[tuple, list[str]]:
    skipped = []
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            return check(path), skipped
        except CheckpointError as e:
            skipped.append(str(e))
            if errors is not None:
                errors.append(e)
    return (None, None), skipped


def remove_stale_tmp(run_dir: str | Path) -> list[Path]:
    """Delete the leftovers of andrea's own interrupted atomic writes (checkpoints, companions, sidecars, data
    manifests: their exact `<name>.tmp`, regular files only) and return them. A user's `notes.tmp`, or a
    directory under one of those names, is not andrea's and is left alone."""
    run_dir = Path(run_dir)
    candidates = [(p, False) for p in run_dir.glob(f"*{TMP_SUFFIX}")]
    candidates += [(p, True) for p in run_dir.glob(f"{DATA_DIR}/*{TMP_SUFFIX}")]
    stale = sorted(p for p, in_data in candidates if is_own_tmp(p.name, in_data) and _regular(p))
    for p in stale:
        p.unlink(missing_ok=True)
    return stale
