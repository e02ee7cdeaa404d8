"""A source file's bytes as a stream of blocks, decompressed by what its first bytes say it is.

Reads one user file and writes nothing. The format is told by magic bytes, not by the name: gzip, zstd (through
the `zstandard` package), bzip2 and xz (the standard library's `zlib`, `bz2`, `lzma`) are decompressed on the
fly, members and frames concatenated; a file that ends inside a member or frame is refused (a truncated download
is never prepared as if whole), and so is a file whose name promises a compression its bytes do not have. Archives
and compressions andrea does not read (zip, 7-Zip, RAR, LZ4, tar) are refused in one line that says to unpack them.
`looks_binary` tells a binary file (audio, images, executables) from text by its first decompressed bytes.
Each decompression call is fed a bounded slice of input and asked for a bounded output, so memory is a few
blocks whatever the file.
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from collections.abc import Iterator
from pathlib import Path

from andrea.data.sources import DataError

RAW_BLOCK = 1 << 20  # bytes read from disk per call, and most decompressed bytes per block
ZSTD_FEED = 1 << 13  # compressed bytes per zstd call (it has no output bound): output stays a few MiB
SNIFF_BYTES = 1 << 13  # the head that decides "binary"

_COMPRESSED = {"gzip": (b"\x1f\x8b",), "zstd": (b"\x28\xb5\x2f\xfd",), "bzip2": (b"BZh",),
               "xz": (b"\xfd7zXZ\x00",)}
_EXTENSIONS = {".gz": "gzip", ".gzip": "gzip", ".zst": "zstd", ".zstd": "zstd", ".bz2": "bzip2", ".xz": "xz"}
_UNREAD = ((b"PK\x03\x04", "a zip archive"), (b"PK\x05\x06", "a zip archive"), (b"7z\xbc\xaf\x27\x1c",
           "a 7-Zip archive"), (b"Rar!\x1a\x07", "a RAR archive"), (b"\x04\x22\x4d\x18", "an LZ4 file"),
           (b"\x89LZO\x00", "an LZO file"))
_UNREAD_EXT = {".zip": "a zip archive", ".7z": "a 7-Zip archive", ".rar": "a RAR archive", ".lz4": "an LZ4 file",
               ".tar": "a tar archive", ".tgz": "a tar archive", ".lzma": "an LZMA file", ".br": "a Brotli file"}
SUPPORTED = "plain text, .gz, .zst, .bz2 and .xz"


def sniff(head: bytes) -> str | None:
    """The compression `head` (a file's first bytes) starts with, or None for plain data."""
    for fmt, magics in _COMPRESSED.items():
        if head.startswith(magics):
            if fmt == "bzip2" and not (len(head) >= 4 and head[3:4].isdigit()):
                continue  # "BZh" then the block size digit: plain text may start with "BZh"
            return fmt
    return None


def unread_format(head: bytes, name: str) -> str | None:
    """What an archive or unsupported compression is called, when `head` or the name says it is one."""
    for magic, what in _UNREAD:
        if head.startswith(magic):
            return what
    if len(head) >= 262 and head[257:262] == b"ustar":
        return "a tar archive"
    suffix = Path(name.lower()).suffix
    return _UNREAD_EXT.get(suffix)


def looks_binary(head: bytes) -> bool:
    """A NUL byte or mostly undecodable bytes in the first few KiB: not text (git and grep decide the same way)."""
    head = head[:SNIFF_BYTES]
    if b"\x00" in head:
        return True
    bad = len(head) - len(head.decode("utf-8", "ignore").encode())
    return bad > len(head) // 4  # text in a legacy encoding has a few; audio and images are mostly such bytes


def _decompressor(fmt: str, path: Path):
    if fmt == "gzip":
        return zlib.decompressobj(wbits=47)  # 32 + 15: gzip or zlib header, auto-detected
    if fmt == "bzip2":
        return bz2.BZ2Decompressor()
    if fmt == "xz":
        return lzma.LZMADecompressor(lzma.FORMAT_XZ)
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{path}: reading .zst files needs the zstandard package (pip install zstandard)") from None
    return zstandard.ZstdDecompressor().decompressobj()


def _inflate(f, fmt: str, path: Path, counts) -> Iterator[bytes]:
    """Decompressed blocks of a whole file of `fmt`, members and frames one after another; refused if truncated."""
    errors = (zlib.error, OSError, EOFError, lzma.LZMAError, ValueError)
    if fmt == "zstd":
        import zstandard
        errors += (zstandard.ZstdError,)
    d = _decompressor(fmt, path)
    fresh = True  # no byte of the current member fed yet
    for block in iter(lambda: f.read(RAW_BLOCK), b""):
        counts.raw_bytes += len(block)
        while block:
            if d.eof:  # the member ended: what follows is the next one (or trailing garbage)
                d, fresh = _decompressor(fmt, path), True
            feed = block[:ZSTD_FEED] if fmt == "zstd" else block
            try:
                if fmt == "zstd":
                    out, block = d.decompress(feed), block[len(feed):]
                    block = d.unused_data + block if d.eof else block
                elif fmt == "gzip":
                    out = d.decompress(block, RAW_BLOCK)
                    block = d.unconsumed_tail or d.unused_data
                else:  # bz2, lzma: input kept inside, drained with empty calls while it still has output
                    out = d.decompress(block, RAW_BLOCK)
                    block = d.unused_data if d.eof else b""
                    while not d.eof and not d.needs_input:
                        if out:
                            yield out
                        out = d.decompress(b"", RAW_BLOCK)
                    if d.eof:
                        block = d.unused_data
            except errors as e:
                raise DataError(f"{path}: not a valid {fmt} file: {e} (andrea reads {SUPPORTED} files)") from None
            fresh = False
            if out:
                yield out
    if not fresh and not d.eof:
        raise DataError(f"{path}: truncated {fmt} file (it ends inside a compressed block: download or copy it "
                        f"again)")


def raw_blocks(path: Path, counts, start: int = 0) -> Iterator[bytes]:
    """The file's decompressed bytes from byte `start` of the decompressed stream on, block by block.

    A plain file is read from `start` (seek); a compressed one is inflated from its beginning (its bytes
    before `start` are read and dropped)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{path}: the source file vanished during preparation") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror}") from None
    with f:
        head = f.read(512)
        f.seek(0)
        fmt, promised = sniff(head), _EXTENSIONS.get(Path(path.name.lower()).suffix)
        if promised and fmt != promised:
            raise DataError(f"{path}: not a valid {promised} file (its first bytes are not {promised}'s)")
        what = unread_format(head, path.name) if fmt is None else None
        if what:
            raise DataError(f"{path}: {what}, which andrea does not read (it reads {SUPPORTED} files): unpack it "
                            f"and point the source at its files")
        if fmt is None:
            f.seek(start)
            counts.raw_bytes += start
            blocks = iter(lambda: f.read(RAW_BLOCK), b"")
            for block in blocks:
                counts.raw_bytes += len(block)
                yield block
            return
        first = True
        for block in _inflate(f, fmt, path, counts):
            if first:
                first = False
                inner = unread_format(block[:512], "")
                if inner:
                    raise DataError(f"{path}: {inner} compressed with {fmt}, which andrea does not read: unpack "
                                    f"it and point the source at its files")
            if start >= len(block):
                start -= len(block)
                continue
            yield block[start:] if start else block
            start = 0
