"""The checkpoint file `step_NNNNNN.bin`: its format, its atomic commit, its validation and its retention.

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
`write_regions` writes (byte offset, bytes) pieces buffered: the fallback path, and tools.

Writing at the disk's limit (O_DIRECT). O_DIRECT moves bytes from user memory to the device with no page-cache
copy (a few ms of CPU for 150 MB instead of tens to hundreds), but wants the buffer address, the file offset and
every write's length aligned to the logical block size. The 8-byte header puts the payload off alignment, so the
whole file is staged as one *image* in one DIRECT_ALIGN-aligned buffer: header at byte 0, `[w | m | v]` at byte 8
(the trainer's snapshot lands there directly), zeros up to `image_bytes(n)`. `commit_image` writes the padded
image with O_DIRECT, then `ftruncate`s the file to 8 + 12·n: the bytes on disk are exactly the format above.
A filesystem that refuses O_DIRECT (EINVAL at open or at the first write: tmpfs before Linux 6.6, ZFS before 2.3,
some network filesystems; EFAULT at the first write: a buffer the kernel cannot pin) gets the same image written
buffered (`write_regions`), said once in the log (`DirectIO` remembers the refusal for the writer's lifetime).
Any other error (ENOSPC, EIO) fails the commit, as it does on the buffered path.

Commit protocol (a checkpoint is trusted only when its commit completed), the same on both paths: write
`step_NNNNNN.bin.tmp`, fsync it, rename it onto `step_NNNNNN.bin`, fsync the directory (`publish_checkpoint`).
A crash at any point leaves either the old set of checkpoints or the old set plus the complete new one; a
`.tmp` is never read as a checkpoint and is removed at the next start. A failed write removes its `.tmp`.
The `.tmp` may start out as the run directory's spare, a checkpoint retention released, renamed onto it so the
write overwrites allocated blocks instead of allocating new ones (rundir/spare.py); the O_DIRECT write covers
every byte of the file and the ftruncate sets its length, so nothing of the released checkpoint survives.

Integrity: the image's content checksum (rundir/checksum.py, `step_NNNNNN.sum.json`) is computed on a side
thread while the image is written, and made durable after the `.tmp` and before the rename, so every committed
checkpoint has one. Validation, cheapest first: the name parses; the size is 8 + 12·n; the header step equals the
name's step; n_params equals the model's; (deep) the bytes are the ones the checksum recorded (a checkpoint from
before checksums is unverifiable, not broken), every float is finite and v ≥ 0.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea.rundir import checksum, spare
from andrea.rundir import atomic
from andrea.rundir.names import DATA_DIR, TMP_SUFFIX, checkpoint_name, is_own_tmp, step_of

HEADER = struct.Struct("<ii")
WRITE_CHUNK = 64 << 20  # bytes per write() call: bounded syscalls, lets a slow disk report progress
# O_DIRECT alignment of buffer address, file offset and write length: logical block sizes are 512 or 4096 on
# current disks, so 4096 serves both; a device needing more refuses the first write (EINVAL) -> buffered.
DIRECT_ALIGN = 4096
# errnos of an O_DIRECT refusal at the first write, where the buffered path takes over: EINVAL (the filesystem, or
# an alignment the device wants larger), EFAULT (memory the kernel cannot pin for DMA: pinned CUDA host memory is
# under some sandboxes; a buffered write copies from it fine). The one-file and the sharded writer share them.
DIRECT_REFUSED_AT_WRITE = (errno.EINVAL, errno.EFAULT)

log = logging.getLogger("andrea.checkpoint")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message is one line naming the file and the problem."""


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
    if not deep:
        return CheckpointInfo(path, step, n)
    recorded = _recorded_checksum(path)  # read first: a checksum that vanishes with its file is no false alarm
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    return _check_image(path, data, step, n, recorded)


def _recorded_checksum(path: Path) -> dict | None:
    """The checkpoint's `.sum.json`; None for one from before checksums. CheckpointError for one that cannot be
    read, or that is missing or another run's where its companions say it should be this run's
    (checksum.companion_problem): unverified, refused like a bad one."""
    try:
        recorded = checksum.read(path)
    except checksum.ChecksumError as e:
        raise CheckpointError(str(e)) from None
    problem = checksum.check_companions(path, recorded)
    if problem is not None:
        raise CheckpointError(f"{path}: {problem}")
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
    image = np.fromfile(path, dtype=np.uint8)
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


def newest_loaded(run_dir: str | Path, n_params: int) -> tuple[CheckpointInfo | None, np.ndarray | None, list[str]]:
    """`newest_valid` with the payload it checked (`load`): a start reads its checkpoint once."""
    (info, payload), skipped = _newest(run_dir, lambda path: load(path, n_params))
    return info, payload, skipped


def _newest(run_dir, check) -> tuple[tuple, list[str]]:
    skipped = []
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            return check(path), skipped
        except CheckpointError as e:
            skipped.append(str(e))
    return (None, None), skipped


def write_regions(path: str | Path, regions: Iterable[tuple[int, memoryview | bytes]], size: int) -> None:
    """Write pieces at byte offsets into `path` (created, sized to `size`) and fsync it (buffered I/O)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        for offset, data in regions:
            pwrite_all(fd, memoryview(data).cast("B"), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """pwrite all of `view` at `offset`, in WRITE_CHUNK calls, continuing short writes (the sharded writer's too)."""
    for lo in range(0, len(view), WRITE_CHUNK):
        chunk = view[lo:lo + WRITE_CHUNK]
        written = 0
        while written < len(chunk):
            written += os.pwrite(fd, chunk[written:], offset + lo + written)


# --- the staged file image and its O_DIRECT write -------------------------------------------------------------
def image_bytes(n_params: int) -> int:
    """Bytes of a staged file image: the checkpoint rounded up to DIRECT_ALIGN (the tail is truncated away)."""
    return -(-checkpoint_bytes(n_params) // DIRECT_ALIGN) * DIRECT_ALIGN


def aligned_image(n_params: int) -> np.ndarray:
    """A zeroed uint8 array of image_bytes(n) at a DIRECT_ALIGN-aligned address (over-allocated, then sliced)."""
    size = image_bytes(n_params)
    raw = np.zeros(size + DIRECT_ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % DIRECT_ALIGN
    return raw[skip:skip + size]


def address(buffer) -> int:
    return np.frombuffer(buffer, dtype=np.uint8).ctypes.data


class DirectIO:
    """Whether commits use O_DIRECT: on until a filesystem refuses it, then buffered, said in ONE log line.

    One per CheckpointWriter (one run directory), so the refusal is learned at the first commit and the
    following commits go buffered without asking again. `refusal` keeps the line that was logged.
    """

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and hasattr(os, "O_DIRECT")
        self.refusal: str | None = None

    def refuse(self, path: Path, where: str, err: OSError) -> None:
        self.enabled = False
        self.refusal = (f"{path.parent}: the filesystem refuses O_DIRECT ({where}: {err.strerror or err}); "
                        "checkpoints here are written buffered (page cache + fsync) from now on")
        log.warning("%s", self.refusal)


class _Refused(Exception):
    """O_DIRECT is not possible here (args: where): EINVAL at the open or the first write (the filesystem), or
    EFAULT at the first write (memory the kernel cannot pin for DMA; a buffered write copies from it fine)."""


def _write_direct(path: str | Path, padded: memoryview, size: int) -> None:
    """O_DIRECT write of the aligned `padded` image, ftruncate to `size`, fsync (the size and the disk cache)."""
    try:
        # Never O_TRUNC: a claimed spare keeps its blocks; the image covers [0, size) and the ftruncate cuts.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise _Refused("open") from e
        raise
    try:
        try:  # a refusal shows at the first write; later writes are past that question
            first = os.pwrite(fd, padded[:min(len(padded), WRITE_CHUNK)], 0)
        except OSError as e:
            if e.errno in DIRECT_REFUSED_AT_WRITE:
                raise _Refused("first write") from e
            raise
        pwrite_all(fd, padded[first:], first)  # a short DIO write stops on a block boundary: still aligned
        os.ftruncate(fd, size)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_image(path: str | Path, image, size: int, direct: DirectIO) -> None:
    """Write the first `size` bytes of the aligned image to `path` (created or truncated) and fsync it.

    With `direct` enabled: O_DIRECT from `image` itself, all of it up to the next DIRECT_ALIGN boundary, then
    ftruncate to `size`. Refused (EINVAL at open, DIRECT_REFUSED_AT_WRITE at the first write): `direct` turns
    off, and the same bytes are written buffered. Any other error propagates (the caller removes the file).
    """
    view = memoryview(image).cast("B")
    padded = -(-size // DIRECT_ALIGN) * DIRECT_ALIGN
    if direct.enabled:
        if len(view) < padded or address(view) % DIRECT_ALIGN:
            raise ValueError(f"an O_DIRECT image must be {DIRECT_ALIGN}-aligned and hold {padded} bytes "
                             f"(got {len(view)} at address {address(view):#x}); see aligned_image")
        try:
            _write_direct(path, view[:padded], size)
            return
        except _Refused as e:
            direct.refuse(Path(path), e.args[0], e.__cause__)
    write_regions(path, [(0, view[:size])], size)


def publish_checkpoint(tmp: str | Path, final: str | Path) -> Path:
    """The commit point: rename a complete, fsynced `.tmp` onto its checkpoint name, then fsync the directory.

    A failed rename removes the `.tmp` and propagates. ZeRO-1: rank 0 calls this once every rank's vote says
    that its blocks of the shared `.tmp` are durable (andrea/commit/shards.py).
    """
    return atomic.publish(Path(tmp), Path(final))


def commit_image(run_dir: str | Path, step: int, image, n_params: int, *, direct: DirectIO,
                 before_rename: Callable[[], None] | None = None) -> Path:
    """Durably write `step_NNNNNN.bin` from a staged image: `[w | m | v]` at byte 8 (see `aligned_image`).

    Writes the header into the image's first 8 bytes, then tmp (the run directory's spare when it has one)
    -> fsync -> rename -> directory fsync.
    `before_rename` runs when the temporary file is complete and fsynced (the fault suite's hook).
    On any error the temporary file is removed and the exception propagates; existing checkpoints are untouched.
    """
    view = memoryview(image).cast("B")
    size = checkpoint_bytes(n_params)
    if len(view) < size:
        raise ValueError(f"an image of {len(view)} bytes cannot hold a checkpoint of {size} bytes")
    view[:HEADER.size] = header(step, n_params)
    run_dir = Path(run_dir)
    final = run_dir / checkpoint_name(step)
    tmp = final.with_name(final.name + TMP_SUFFIX)
    # The checksum is of the image being written, hashed meanwhile: the write spends its time in the kernel
    # (the GIL released), the hash in xxhash; the commit waits for the later of the two, not their sum.
    with ThreadPoolExecutor(1, thread_name_prefix="andrea-checksum") as hashing:
        digests = hashing.submit(checksum.image_digests, view[:size], n_params)
        try:
            spare.claim(tmp)
            write_image(tmp, view, size, direct)
            checksum.write(final, step, n_params, digests.result())
            if before_rename is not None:
                before_rename()
        except BaseException:
            tmp.unlink(missing_ok=True)
            if not final.exists():
                checksum.sum_path(final).unlink(missing_ok=True)
            raise
    return publish_checkpoint(tmp, final)


def commit_checkpoint(run_dir: str | Path, step: int, payload: np.ndarray | memoryview,
                      before_rename: Callable[[], None] | None = None, *, direct: DirectIO | None = None) -> Path:
    """`commit_image` of a float32 payload [w | m | v] (length 3·n), copied into a fresh aligned image.

    For callers without a staged image (tools, tests); the trainer's writer snapshots straight into its image.
    Without `direct`, O_DIRECT is tried and a refusal is logged for this call.
    """
    view = memoryview(payload).cast("B")
    n = len(view) // 12
    if len(view) != 12 * n:
        raise ValueError(f"payload of {len(view)} bytes is not three float32 regions")
    image = aligned_image(n)
    image[HEADER.size:HEADER.size + len(view)] = np.frombuffer(view, dtype=np.uint8)
    return commit_image(run_dir, step, image, n, direct=direct if direct is not None else DirectIO(),
                        before_rename=before_rename)


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


def retention_victims(steps: Iterable[int], keep_last: int, keep_every: int,
                      protect: Iterable[int] = ()) -> list[int]:
    """Steps to delete: all but the newest `keep_last`, sparing multiples of `keep_every` (major checkpoints)
    and the `protect`ed steps (the divergence guard's known-good checkpoint, guard/decisions.py)."""
    ordered = sorted(set(steps))
    recent = set(ordered[-keep_last:]) if keep_last > 0 else set()
    spared = recent | set(protect)
    return [s for s in ordered if s not in spared and not (keep_every and s % keep_every == 0)]
