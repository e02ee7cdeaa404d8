"""Reading a source as a stream of text pieces, in bounded memory, from any position a preparation stopped at.

Reads user files (text, JSON lines, parquet; `.gz` and `.zst` decompressed on the fly) and nothing else. Every
reader yields `Piece`s: at most `SEGMENT_BYTES` of text each, so one huge file (a 13 GB `corpus.txt`) or one huge
record never sits in memory whole. A piece carries the reader's position after it (`end`: a byte offset in the
decompressed stream, or a row index for parquet), and `resumable` when a preparation may stop there and later
restart by calling the reader again with `start=end`: the pieces that follow are then the same as in an
uninterrupted read. `doc_end` marks the last piece of a document (the tokenizer's <|endoftext|> follows it).

Long documents are cut where the tokenizer's pre-tokenization (GPT-2's byte-level split, also the one andrea
trains) cuts anyway: at a single ASCII newline or space between two non-whitespace characters. So the tokens of the
pieces of a document equal the tokens of the whole document, except in text without such a place in 64 KiB
(minified or binary data), which is cut at a character boundary.

Undecodable bytes become U+FFFD and are counted (`Counts`), as are empty files and JSON lines or parquet rows that
are not documents (the first one named as file:line or file:row); nothing here raises on bad content.
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from andrea.data.sources import DataError

SEGMENT_BYTES = 1 << 16  # longest piece handed to the tokenizer: a 2 MiB chunk is >= 32 of them, for 32 cores
RAW_BLOCK = 1 << 20  # bytes read from disk per call
# Bytes that may end a whitespace character in UTF-8 (U+0085, U+00A0, U+1680, U+2000-200A, U+2028, U+2029, U+202F,
# U+205F, U+3000) and lead bytes that may start one: a cut is never placed next to them.
_WS_TAIL = frozenset(range(0x80, 0x8B)) | {0x9F, 0xA0, 0xA8, 0xA9, 0xAF}
_WS_LEAD = frozenset({0xC2, 0xE1, 0xE2, 0xE3})
_ASCII_WS = frozenset(b" \t\n\r\x0b\x0c")
_ESCAPED = re.compile("[\udc80-\udcff]")  # surrogateescape's stand-ins for undecodable bytes


@dataclass
class Piece:
    text: str
    end: int  # reader position after this piece
    doc_end: bool  # the last piece of a document
    resumable: bool  # a preparation may stop after this piece and restart at `end`
    line: int = 0  # jsonl: the number of the line at `end` (so a resumed reader still names file:line)


@dataclass
class Counts:
    """What a source held that is not text; reported once per arm."""

    undecodable_bytes: int = 0
    empty_files: int = 0
    skipped_records: int = 0
    first_skipped: str | None = None  # "file:line: why"
    first_empty: str | None = None
    raw_bytes: int = 0  # bytes read from disk (compressed size for .gz/.zst): the progress bar's measure

    def skip(self, where: str) -> None:
        self.skipped_records += 1
        self.first_skipped = self.first_skipped or where

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "raw_bytes"}


# --- bytes ---------------------------------------------------------------------------------------------------
def raw_blocks(path: Path, counts: Counts) -> Iterator[bytes]:
    """The file's decompressed bytes, block by block (gzip members concatenated; zstd frames likewise)."""
    try:
        f = open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"{path}: the source file vanished during preparation") from None
    except OSError as e:
        raise DataError(f"{path}: cannot read: {e.strerror}") from None
    with f:
        name = path.name.lower()
        if name.endswith(".gz"):
            inflate = zlib.decompressobj(wbits=47)  # 32 + 15: gzip or zlib header, auto-detected
            for block in iter(lambda: f.read(RAW_BLOCK), b""):
                counts.raw_bytes += len(block)
                while block:
                    try:
                        out = inflate.decompress(block)
                    except zlib.error as e:
                        raise DataError(f"{path}: not a valid gzip file: {e}") from None
                    if out:
                        yield out
                    block = inflate.unused_data  # the next gzip member, if any
                    if block:
                        inflate = zlib.decompressobj(wbits=47)
            if not inflate.eof:
                raise DataError(f"{path}: truncated gzip file")
        elif name.endswith(".zst"):
            try:
                import zstandard
            except ImportError:
                raise DataError(f"{path}: reading .zst files needs the zstandard package "
                                "(pip install zstandard)") from None
            reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
            try:
                for block in iter(lambda: reader.read(RAW_BLOCK), b""):
                    counts.raw_bytes = f.tell()
                    yield block
            except zstandard.ZstdError as e:
                raise DataError(f"{path}: not a valid zstd file: {e}") from None
        else:
            for block in iter(lambda: f.read(RAW_BLOCK), b""):
                counts.raw_bytes += len(block)
                yield block


def decode(data: bytes, counts: Counts) -> str:
    """UTF-8 text; each undecodable byte becomes U+FFFD and is counted."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text, bad = _ESCAPED.subn("\ufffd", data.decode("utf-8", "surrogateescape"))
        counts.undecodable_bytes += bad
        return text


def cut_point(buf: bytes | bytearray, limit: int) -> int:
    """Where to end a piece of `buf` (len > limit): after index i < limit, a place pre-tokenization splits anyway."""
    floor = limit // 2
    for sep in (b"\n", b" "):
        i = buf.rfind(sep, floor, limit)
        while i > floor:
            before, after = buf[i - 1], buf[i + 1]
            if (before not in _ASCII_WS and before not in _WS_TAIL and after not in _ASCII_WS
                    and after not in _WS_LEAD):
                return i + 1 if sep == b"\n" else i  # "\n" ends a pre-token, " " starts one
            i = buf.rfind(sep, floor, i)
    i = limit
    while i > 1 and (buf[i] & 0xC0) == 0x80:  # never inside a UTF-8 character
        i -= 1
    return i


def _split(data: bytes, start: int, counts: Counts, resumable: bool) -> Iterator[Piece]:
    """One document's bytes as pieces; `start` is the position of data[0]."""
    pos = 0
    while len(data) - pos > SEGMENT_BYTES:
        cut = pos + cut_point(data[pos:pos + SEGMENT_BYTES + 1], SEGMENT_BYTES)
        yield Piece(decode(data[pos:cut], counts), start + cut, False, resumable)
        pos = cut
    yield Piece(decode(data[pos:], counts), start + len(data), True, True)


# --- readers -------------------------------------------------------------------------------------------------
def _skip(blocks: Iterator[bytes], start: int) -> Iterator[bytes]:
    """The blocks of a stream from byte `start` on (a compressed file is still inflated from its beginning)."""
    for block in blocks:
        if start >= len(block):
            start -= len(block)
            continue
        yield block[start:] if start else block
        start = 0


def text_pieces(path: Path, start: int, counts: Counts) -> Iterator[Piece]:
    """A text file as one document, in pieces; every piece boundary is resumable."""
    buf, pos = bytearray(), start  # pos: the stream offset of buf[0]
    for block in _skip(raw_blocks(path, counts), start):
        buf += block
        while len(buf) > SEGMENT_BYTES:
            cut = cut_point(buf, SEGMENT_BYTES)
            pos += cut
            yield Piece(decode(bytes(buf[:cut]), counts), pos, False, True)
            del buf[:cut]
    if not buf and pos == 0:
        counts.empty_files += 1
        counts.first_empty = counts.first_empty or str(path)
        return
    yield Piece(decode(bytes(buf), counts), pos + len(buf), True, True)


def _lines(path: Path, start: int, counts: Counts) -> Iterator[tuple[int, bytes]]:
    """(offset of the line, line without its newline), from byte offset `start` of the decompressed stream."""
    pending, offset = bytearray(), start  # offset: the stream offset of pending[0]
    for block in _skip(raw_blocks(path, counts), start):
        pending += block
        lo = 0
        while (nl := pending.find(b"\n", lo)) >= 0:
            yield offset + lo, bytes(pending[lo:nl])
            lo = nl + 1
        del pending[:lo]
        offset += lo
    if pending:
        yield offset, bytes(pending)


def jsonl_pieces(path: Path, start: int, counts: Counts, key: str, line: int = 1) -> Iterator[Piece]:
    """One document per JSON line (`key` holds its text); a record's last piece is resumable.

    `line` is the number of the line at `start`, so a resumed reader still names bad lines as file:line."""
    number = line
    any_line = False
    for offset, raw in _lines(path, start, counts):
        end = offset + len(raw) + 1
        any_line = True
        where = f"{path}:{number}"
        number += 1
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            counts.skip(f"{where}: not JSON ({e.msg if isinstance(e, json.JSONDecodeError) else 'not UTF-8'})")
            continue
        text = record.get(key) if isinstance(record, dict) else None
        if not isinstance(text, str):
            counts.skip(f"{where}: no string field {key!r}")
            continue
        if not text:
            continue
        for piece in _split(text.encode("utf-8", "surrogatepass"), offset, counts, False):
            if piece.doc_end:
                piece.end, piece.line = end, number
            yield piece
    if not any_line and start == 0:
        counts.empty_files += 1
        counts.first_empty = counts.first_empty or str(path)


def parquet_pieces(path: Path, start: int, counts: Counts, column: str) -> Iterator[Piece]:
    """One document per row of `column`, read one row group at a time; positions are row indices."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs the pyarrow package (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(path)
    except FileNotFoundError:
        raise DataError(f"{path}: the source file vanished during preparation") from None
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise DataError(f"{path}: not a parquet file: {str(e).splitlines()[0]}") from None
    if column not in pf.schema_arrow.names:
        raise DataError(f"{path}: no column {column!r} (columns: {', '.join(pf.schema_arrow.names)})")
    meta = pf.metadata
    if meta.num_rows == 0:
        counts.empty_files += 1
        counts.first_empty = counts.first_empty or str(path)
        return
    row = 0
    for g in range(meta.num_row_groups):
        rows_in_group = meta.row_group(g).num_rows
        if row + rows_in_group <= start:
            row += rows_in_group
            continue
        counts.raw_bytes += path.stat().st_size * rows_in_group // meta.num_rows  # progress, in file bytes
        values = pf.read_row_group(g, columns=[column]).column(0).to_pylist()
        for i, text in enumerate(values):
            if row + i < start:
                continue
            if not isinstance(text, str):
                counts.skip(f"{path}:row {row + i}: {column!r} is {type(text).__name__}, not text")
                continue
            if not text:
                continue
            for piece in _split(text.encode("utf-8", "surrogatepass"), row + i, counts, False):
                piece.end = row + i + 1 if piece.doc_end else piece.end
                yield piece
        row += rows_in_group
        del values


def pieces(path: Path, kind: str, key: str, start: int, counts: Counts, line: int = 1) -> Iterator[Piece]:
    """The pieces of one source file from position `start` (0: its beginning)."""
    if kind == "text":
        return text_pieces(path, start, counts)
    if kind == "jsonl":
        return jsonl_pieces(path, start, counts, key, line)
    if kind == "parquet":
        return parquet_pieces(path, start, counts, key)
    raise DataError(f"{path}: kind {kind!r} is not text")


@dataclass
class Documents:
    """The text of built-in documents (already strings) as pieces; positions are document indices."""

    docs: Iterator[str]
    counts: Counts = field(default_factory=Counts)

    def pieces(self, start: int) -> Iterator[Piece]:
        for i, doc in enumerate(self.docs):
            if i < start or not doc:
                continue
            data = doc.encode("utf-8", "surrogatepass")
            self.counts.raw_bytes += len(data)
            for piece in _split(data, i, self.counts, False):
                piece.end = i + 1 if piece.doc_end else piece.end
                yield piece
