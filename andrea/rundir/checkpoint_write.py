"""Writing `step_NNNNNN.bin` (the format: rundir/checkpoint.py): O_DIRECT from a staged image, or buffered, and
its atomic commit. Writes the `.tmp`, the `.sum.json` (rundir/checksum.py) and the checkpoint; reads nothing.

Writing at the disk's limit (O_DIRECT). O_DIRECT moves bytes from user memory to the device with no page-cache
copy (a few ms of CPU for 150 MB instead of tens to hundreds), but wants the buffer address, the file offset and
every write's length aligned to the logical block size. The 8-byte header puts the payload off alignment, so the
whole file is staged as one *image* in one DIRECT_ALIGN-aligned buffer: header at byte 0, `[w | m | v]` at byte 8
(the trainer's snapshot lands there directly), zeros up to `image_bytes(n)`. `commit_image` writes the padded
image with O_DIRECT, then `ftruncate`s the file to 8 + 12·n: the bytes on disk are exactly the format.
A filesystem that refuses O_DIRECT (EINVAL at open or at the first write: tmpfs before Linux 6.6, ZFS before 2.3,
some network filesystems; EFAULT at the first write: a buffer the kernel cannot pin) gets the same image written
buffered (`write_regions`), said once in the log (`DirectIO` remembers the refusal for the writer's lifetime).
Any other error (ENOSPC, EIO) fails the commit, as it does on the buffered path. `write_regions` writes
(byte offset, bytes) pieces buffered: the fallback path, and tools.

Commit protocol, the same on both paths: write `step_NNNNNN.bin.tmp`, fsync it, rename it onto `step_NNNNNN.bin`,
fsync the directory (`publish_checkpoint`). A failed write removes its `.tmp`. The `.tmp` may start out as the run
directory's spare, a checkpoint retention released, renamed onto it so the write overwrites allocated blocks
instead of allocating new ones (rundir/spare.py); the O_DIRECT write covers every byte of the file and the
ftruncate sets its length, so nothing of the released checkpoint survives.

Integrity: the image's content checksum (`step_NNNNNN.sum.json`) is computed on a side thread while the image is
written, and made durable after the `.tmp` and before the rename, so every committed checkpoint has one.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from andrea.rundir import atomic, checksum, spare
from andrea.rundir.checkpoint import HEADER, WRITE_CHUNK, checkpoint_bytes, header
from andrea.rundir.names import TMP_SUFFIX, checkpoint_name

# O_DIRECT alignment of buffer address, file offset and write length: logical block sizes are 512 or 4096 on
# current disks, so 4096 serves both; a device needing more refuses the first write (EINVAL) -> buffered.
DIRECT_ALIGN = 4096
# errnos of an O_DIRECT refusal at the first write, where the buffered path takes over: EINVAL (the filesystem, or
# an alignment the device wants larger), EFAULT (memory the kernel cannot pin for DMA: pinned CUDA host memory is
# under some sandboxes; a buffered write copies from it fine). The one-file and the sharded writer share them.
DIRECT_REFUSED_AT_WRITE = (errno.EINVAL, errno.EFAULT)

log = logging.getLogger("andrea.checkpoint")


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
    that its blocks of the shared `.tmp` are durable (andrea/control/commit/shards.py).
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
