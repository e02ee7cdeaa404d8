"""Reading a source as a stream of text pieces, in bounded memory, from any position a preparation stopped at.

Reads user files (text, JSON lines, parquet; compressed ones through streams.py) and nothing else. Every reader
yields `Piece`s: at most `SEGMENT_BYTES` of text each, so neither a huge file (a 13 GB `corpus.txt`), nor a huge
JSON record (read as a stream: jsonscan.py), nor a huge parquet row group (read in slices of ~`BATCH_BYTES`) sits
in memory whole. Every piece is a place a preparation may stop at: it carries the reader's position after it
(`end`: a byte offset in the decompressed stream, or a row index for parquet; `inner`: the bytes of its
document's text already read, when the piece is not its document's last; `line`: the JSON line's number), and a
reader called again with those yields the same pieces as an uninterrupted read. `doc_end` marks the last piece of a
document (the tokenizer's <|endoftext|> follows it). Long documents are cut where pre-tokenization cuts anyway
(cuts.py), so the tokens of the pieces equal the tokens of the whole document.

Undecodable bytes become U+FFFD and are counted (`Counts`), as are empty files, binary files in a text source
(skipped: audio, images; streams.looks_binary) and JSON lines or parquet rows that are not documents (the first
one named as file:line or file:row); nothing here raises on bad content. Damaged or unsupported compressed files
are refused (streams.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from andrea.data import jsonscan
from andrea.data.cuts import LOOKAHEAD, cut_point
from andrea.data.sources import DataError
from andrea.data.streams import looks_binary, raw_blocks

SEGMENT_BYTES = 1 << 16  # longest piece handed to the tokenizer: a 2 MiB chunk is >= 32 of them, for 32 cores
LINE_LIMIT = 4 << 20  # a JSON line longer than this is read as a stream (jsonscan.py), not parsed whole
BATCH_BYTES = 8 << 20  # parquet: text per slice of a row group read at once
_ESCAPED = re.compile("[\udc80-\udcff]")  # surrogateescape's stand-ins for undecodable bytes


@dataclass
class Piece:
    text: str
    end: int  # reader position after this piece (its document's own position when not doc_end)
    doc_end: bool  # the last piece of a document
    inner: int = 0  # bytes of this document's text read up to this piece's end (0 at doc_end)
    line: int = 0  # jsonl: the number of the line at `end` (so a resumed reader still names file:line)


@dataclass
class Counts:
    """What a source held that is not text; reported once per arm."""

    undecodable_bytes: int = 0
    empty_files: int = 0
    skipped_records: int = 0
    first_skipped: str | None = None  # "file:line: why"
    first_empty: str | None = None
    binary_files: int = 0
    first_binary: str | None = None
    literal_eot: int = 0  # documents' own "<|endoftext|>" strings, encoded as text (encode.py counts them)
    raw_bytes: int = 0  # bytes of the current file read from disk (compressed size): the progress bar's measure

    def skip(self, where: str) -> None:
        self.skipped_records += 1
        self.first_skipped = self.first_skipped or where

    def empty(self, path: Path) -> None:
        self.empty_files += 1
        self.first_empty = self.first_empty or str(path)

    def to_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "raw_bytes"}


def decode(data: bytes, counts: Counts) -> str:
    """UTF-8 text; each undecodable byte becomes U+FFFD and is counted."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text, bad = _ESCAPED.subn("\ufffd", data.decode("utf-8", "surrogateescape"))
        counts.undecodable_bytes += bad
        return text


# --- cutting ---------------------------------------------------------------------------------------------------
def _cut_stream(blocks: Iterable[bytes], skip: int, counts: Counts) -> Iterator[tuple[str, int, bool]]:
    """A document's bytes, streamed, as (text, bytes of the document read so far, last); from byte `skip` on.

    Cuts depend only on the bytes from the previous cut on, so a stream restarted at a cut is cut the same."""
    buf, pos = bytearray(), 0  # pos: the document offset of buf[0]
    for block in blocks:
        if pos + len(block) <= skip:
            pos += len(block)
            continue
        if pos < skip:
            block, pos = block[skip - pos:], skip
        buf += block
        while len(buf) > SEGMENT_BYTES + LOOKAHEAD:
            cut = cut_point(buf, SEGMENT_BYTES)
            pos += cut
            yield decode(bytes(buf[:cut]), counts), pos, False
            del buf[:cut]
    while len(buf) > SEGMENT_BYTES:  # the tail: everything that is left is known
        cut = cut_point(buf, SEGMENT_BYTES)
        pos += cut
        yield decode(bytes(buf[:cut]), counts), pos, False
        del buf[:cut]
    yield decode(bytes(buf), counts), pos + len(buf), True


def _record(data: Iterable[bytes], where: int, after: int, inner: int, counts: Counts,
            line: int = 0) -> Iterator[Piece]:
    """One record's text (at position `where`; the reader's position after it: `after`) as pieces from `inner` on."""
    for text, done, last in _cut_stream(data, inner, counts):
        if last:
            yield Piece(text, after, True, 0, line + 1 if line else 0)
        elif text:
            yield Piece(text, where, False, done, line)


# --- readers -------------------------------------------------------------------------------------------------
def text_pieces(path: Path, start: int, counts: Counts) -> Iterator[Piece]:
    """A text file as one document, in pieces; a binary file is skipped and counted."""
    blocks = raw_blocks(path, counts, start)
    first = next(blocks, b"")
    if start == 0:
        if not first:
            counts.empty(path)
            return
        if looks_binary(first):
            counts.binary_files += 1
            counts.first_binary = counts.first_binary or str(path)
            return
    elif not first:
        return  # resumed at the end: the document's last piece was already read
    whole = _chain(first, blocks)
    for text, done, last in _cut_stream(whole, 0, counts):
        yield Piece(text, start + done, last)


def _chain(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    yield first
    yield from rest


@dataclass
class _Huge:
    """A JSON line over LINE_LIMIT, scanned as it streamed by (jsonscan.Scanner)."""

    scanner: jsonscan.Scanner
    error: str | None


def _lines(path: Path, start: int, counts: Counts, key: str) -> Iterator[tuple[int, bytes | _Huge]]:
    """(offset of the line, line without its newline, or _Huge for a very long one), from byte `start` on."""
    pending, huge = bytearray(), None
    line_start = block_start = start
    for block in raw_blocks(path, counts, start):
        lo = 0
        while (nl := block.find(b"\n", lo)) >= 0:
            if huge is None:
                pending += block[lo:nl]
                yield line_start, bytes(pending)
                pending.clear()
            else:
                _feed(huge, block[lo:nl])
                _finish(huge)
                yield line_start, huge
                huge = None
            lo = nl + 1
            line_start = block_start + lo
        if huge is not None:
            _feed(huge, block[lo:])
        else:
            pending += block[lo:]
            if len(pending) > LINE_LIMIT:
                huge = _Huge(jsonscan.Scanner(key), None)
                _feed(huge, bytes(pending))
                pending.clear()
        block_start += len(block)
    if huge is not None:
        _finish(huge)
        yield line_start, huge
    elif pending:
        yield line_start, bytes(pending)


def _feed(huge: _Huge, data: bytes) -> None:
    if huge.error is None and data:
        try:
            huge.scanner.feed(data)
        except jsonscan.NotJSON as e:
            huge.error = str(e)


def _finish(huge: _Huge) -> None:
    if huge.error is None:
        try:
            huge.scanner.finish()
        except jsonscan.NotJSON as e:
            huge.error = str(e)


def jsonl_pieces(path: Path, start: int, counts: Counts, key: str, line: int = 1, inner: int = 0) -> Iterator[Piece]:
    """One document per JSON line (`key` holds its text). `line` is the number of the line at `start`, so a resumed
    reader still names bad lines as file:line; `inner`: bytes of that line's text already read."""
    number = line - 1
    any_line = False
    for offset, raw in _lines(path, start, counts, key):
        skip, inner = inner, 0  # only the line the reader restarts in was partly read
        any_line = True
        number += 1
        where = f"{path}:{number}"
        if isinstance(raw, _Huge):
            end = offset + raw.scanner.offset + 1
            if raw.error is not None:
                counts.skip(f"{where}: not JSON ({raw.error})")
            elif raw.scanner.span is None:
                counts.skip(f"{where}: no string field {key!r}")
            else:
                a, b = raw.scanner.span
                if b > a:
                    text = jsonscan.unescape(raw_blocks(path, Counts(), offset + a))  # its own stream: a second pass
                    yield from _record(text, offset, end, skip, counts, number)
            continue
        end = offset + len(raw) + 1
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
        if text:
            yield from _record([text.encode("utf-8", "surrogatepass")], offset, end, skip, counts, number)
    if not any_line and start == 0:
        counts.empty(path)


def parquet_pieces(path: Path, start: int, counts: Counts, column: str, inner: int = 0) -> Iterator[Piece]:
    """One document per row of `column`, read in slices of each row group; positions are row indices."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading parquet needs the pyarrow package (pip install pyarrow)") from None
    try:
        pf = pq.ParquetFile(path, buffer_size=1 << 20)  # pages streamed, not a whole column chunk read at once
    except FileNotFoundError:
        raise DataError(f"{path}: the source file vanished during preparation") from None
    except Exception as e:  # pyarrow raises ArrowInvalid and friends
        raise DataError(f"{path}: not a parquet file: {str(e).splitlines()[0]}") from None
    names = pf.schema_arrow.names
    if column not in names:
        raise DataError(f"{path}: no column {column!r} (columns: {', '.join(names)})")
    meta, size = pf.metadata, path.stat().st_size
    if meta.num_rows == 0:
        counts.empty(path)
        return
    leaf = [meta.schema.column(i).path.split(".")[0] for i in range(meta.num_columns)].index(column)
    row = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        if row + group.num_rows <= start:
            row += group.num_rows
            counts.raw_bytes = size * row // meta.num_rows
            continue
        per_row = max(1, group.column(leaf).total_uncompressed_size // max(group.num_rows, 1))
        batch_rows = max(1, min(group.num_rows, BATCH_BYTES // per_row))
        try:
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[g], columns=[column],
                                         use_threads=False):
                values = batch.column(0)
                if row + len(values) <= start:
                    row += len(values)
                    continue
                for i, text in enumerate(values.to_pylist()):
                    if row + i < start:
                        continue
                    skip, inner = (inner if row + i == start else 0), 0
                    if not isinstance(text, str):
                        counts.skip(f"{path}:row {row + i}: {column!r} is {type(text).__name__}, not text")
                    elif text:
                        yield from _record([text.encode("utf-8", "surrogatepass")], row + i, row + i + 1, skip,
                                           counts)
                row += len(values)
                counts.raw_bytes = size * row // meta.num_rows  # progress, in file bytes
                del values, batch
        except OSError as e:  # pyarrow: a damaged page
            raise DataError(f"{path}: damaged parquet file: {str(e).splitlines()[0]}") from None


def pieces(path: Path, kind: str, key: str, start: int, counts: Counts, line: int = 1,
           inner: int = 0) -> Iterator[Piece]:
    """The pieces of one source file from position `start` (0: its beginning), `inner` bytes into its record."""
    if kind == "text":
        return text_pieces(path, start, counts)
    if kind == "jsonl":
        return jsonl_pieces(path, start, counts, key, line, inner)
    if kind == "parquet":
        return parquet_pieces(path, start, counts, key, inner)
    raise DataError(f"{path}: kind {kind!r} is not text")


@dataclass
class Documents:
    """The text of built-in documents (already strings) as pieces; positions are document indices."""

    docs: Iterator[str]
    counts: Counts = field(default_factory=Counts)

    def pieces(self, start: int, inner: int = 0) -> Iterator[Piece]:
        for i, doc in enumerate(self.docs):
            data = doc.encode("utf-8", "surrogatepass")
            self.counts.raw_bytes += len(data)
            if i < start or not doc:
                continue
            yield from _record([data], i, i + 1, inner if i == start else 0, self.counts)
