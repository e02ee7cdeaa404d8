"""Encoding one text arm: its pieces (read.py) gathered into chunks, `encode_batch_fast`, appended to its files.

`ArmJob` runs one arm from its manifest record's cursor to the end of its sources (or its cap). Memory is one
chunk of text and its tokens: pieces are gathered into chunks of `CHUNK_BYTES`, each chunk goes through
`Tokenizer.encode_batch_fast` (parallel in Rust), and its tokens are appended to the arm's token files
(splits.py). Every `COMMIT_SECONDS`, at a stop request and at the arm's end, the token files and the arm's
`files.jsonl` are fsynced, and only then does the manifest (manifest.py) record how far the arm got: a later job
continues from there and ends with the same bytes as an uninterrupted one. Every piece is a place to stop at
(read.py), so a chunk is never larger than `CHUNK_BYTES` plus one piece, whatever a document's size.
`should_stop` is polled between chunks and between source files. A document's own "<|endoftext|>" string is
encoded as text (never as the boundary token) and counted.
Test hooks (andrea/testhooks.py), never set in production: `ANDREA_TEST_FILE_DELAY=<seconds>` sleeps after each source file (a window
for signals); `ANDREA_TEST_STOP_AT_COMMIT=<k>` asks to stop right after the k-th commit of a preparation
(`CommitHook`), so a test can stop at every commit boundary in turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea import testhooks
from andrea.config.corpus import SourceConfig
from andrea.data import manifest as mf, read, splits
from andrea.data.codec import EOT, TextCodec
from andrea.data.sources import DataError, builtin_documents
from andrea.control.observe.progress import ByteProgress

CHUNK_BYTES = 2 << 20  # text per encode_batch call: ~1 s of encoding on two cores
COMMIT_SECONDS = 10.0
SAMPLE_FILE_BYTES = 1 << 16  # the tokenizer's sample takes at least this much from each file it visits


class Interrupted(Exception):
    """A stop request arrived during preparation; what is done is committed. The message says how far it got."""


class CommitHook:
    """Test hook `ANDREA_TEST_STOP_AT_COMMIT=k`: a stop request right after the k-th commit (0: never)."""

    def __init__(self) -> None:
        self.stop_at = testhooks.stop_at_commit()  # ANDREA_TEST_STOP_AT_COMMIT (andrea/testhooks.py)
        self.commits = 0

    def committed(self) -> None:
        self.commits += 1

    def __call__(self) -> bool:
        return bool(self.stop_at) and self.commits >= self.stop_at


def spread(n: int) -> Iterator[int]:
    """0..n-1 in bit-reversed order: every prefix is spread evenly over the range (0, n/2, n/4, 3n/4, ...)."""
    bits = max(1, (n - 1).bit_length())
    for k in range(1 << bits):
        i = int(format(k, f"0{bits}b")[::-1], 2)
        if i < n:
            yield i


@dataclass
class TextArm:
    """One text arm's files (or a built-in's document stream, as one pseudo-file) and its cap."""

    name: str
    kind: str  # text | jsonl | parquet | builtin
    key: str
    cap: int  # bytes of text; 0: none
    source: SourceConfig | None

    @property
    def where(self) -> str:
        return f"data.sources[{self.name!r}] ({self.source.path})" if self.source else f"data.arms[{self.name!r}]"

    def pieces(self, path: Path, start: int, line: int, counts: read.Counts, inner: int = 0) -> Iterator[read.Piece]:
        if self.source is None:
            docs = read.Documents(builtin_documents(self.name), counts)
            return docs.pieces(start, inner)
        return read.pieces(path, self.kind, self.key, start, counts, line, inner)

    def sample(self, budget: int, plan: list[dict], counts: read.Counts | None = None) -> Iterator[str]:
        """`budget` bytes of text (at most the cap) drawn across the files: the heads of files visited in an evenly
        spread order (`spread`), each giving at most max(64 KiB, budget / files), until the budget is met."""
        budget = min(budget, self.cap) if self.cap else budget
        per_file = max(SAMPLE_FILE_BYTES, budget // max(len(plan), 1))
        counts = counts if counts is not None else read.Counts()
        for k in spread(len(plan)):
            left = min(per_file, budget)
            for piece in self.pieces(Path(plan[k]["path"]), 0, 1, counts):
                data = piece.text.encode()
                yield data[:left].decode(errors="ignore") if len(data) > left else piece.text
                left -= len(data)
                budget -= min(len(data), left + len(data))
                if left <= 0:
                    break
            if budget <= 0:
                return


class ArmJob:
    """Encodes one text arm from its record's cursor to the end (or the cap), committing as it goes."""

    def __init__(self, arm: TextArm, record: mf.ArmRecord, plan: list[dict], codec: TextCodec, dtype: np.dtype,
                 data_dir: Path, val_fraction: float, save: Callable[[], None], hook: CommitHook | None = None):
        self.arm, self.rec, self.plan, self.codec, self.save = arm, record, plan, codec, save
        self.hook = hook or CommitHook()
        ext = splits.suffix(dtype)
        self.writer = splits.SplitWriter(data_dir / f"{arm.name}.train.{ext}", data_dir / f"{arm.name}.val.{ext}",
                                         dtype, record.span, val_fraction, record.train_tokens, record.val_tokens)
        self.files = mf.FileLog(data_dir / f"{arm.name}.files.jsonl", record.files_bytes) if arm.source else None
        self.counts = read.Counts(**record.counts)
        self.chunk: list[tuple[int, read.Piece]] = []
        self.chunk_bytes = 0
        self.cursor = {"inner": 0, **record.cursor}
        self.cursor.pop("tokens", None), self.cursor.pop("documents", None)
        # tokens and documents per file index, for its files.jsonl line; a resumed file starts from its cursor's
        self.tally: dict[int, list[int]] = {self.cursor["file"]: [record.cursor.get("tokens", 0),
                                                                 record.cursor.get("documents", 0)]}
        self.finished: list[dict] = []  # file records whose last piece is in the chunk
        self.done_bytes = self.file_size = 0
        self.file_delay = testhooks.file_delay()  # test hook ANDREA_TEST_FILE_DELAY (andrea/testhooks.py)

    def run(self, should_stop: Callable[[], bool], progress: ByteProgress) -> bool:
        """True when the arm is complete; False when stopped (everything read so far committed)."""
        tok = self.codec.tokenizer
        literal = tok.encode_special_tokens
        tok.encode_special_tokens = True  # a document's own "<|endoftext|>" is text, not a boundary
        try:
            return self._run(should_stop, progress)
        except OSError as e:  # a full disk, a read-only mount: the last commit stays the valid state
            where = e.filename or self.writer.paths[0].parent
            raise DataError(f"{where}: cannot write the prepared data: {e.strerror or e} (everything committed "
                            f"before is kept; free space and run again to continue)") from None
        finally:
            tok.encode_special_tokens = literal
            self.writer.close()
            if self.files is not None:
                self.files.close()

    def _run(self, should_stop: Callable[[], bool], progress: ByteProgress) -> bool:
        last_commit = time.monotonic()
        self.done_bytes = sum(e["size"] or 0 for e in self.plan[:self.cursor["file"]])
        progress.advance(self.done_bytes, self.writer.stream)  # a resumed arm: from where it stopped
        for i in range(self.cursor["file"], len(self.plan)):
            entry = self.plan[i]
            path = Path(entry["path"])
            self._check_unchanged(path, entry, "since its preparation began")
            start, line, inner = self.cursor["position"], self.cursor["line"], self.cursor["inner"]
            self.tally.setdefault(i, [0, 0])
            self.done_bytes = sum(e["size"] or 0 for e in self.plan[:i])  # progress: the files before this one
            self.file_size = entry["size"] or 0
            self.counts.raw_bytes = 0
            for piece in self.arm.pieces(path, start, line, self.counts, inner):
                if self.arm.cap and self.rec.text_bytes >= self.arm.cap:
                    self.rec.capped = True
                    break
                self._add(i, piece)
                self.cursor = {"file": i, "position": piece.end, "line": piece.line or 1, "inner": piece.inner}
                if self.chunk_bytes >= CHUNK_BYTES:
                    self._flush(progress)
                    if should_stop() or time.monotonic() - last_commit > COMMIT_SECONDS:
                        self._commit()
                        last_commit = time.monotonic()
                        if should_stop():
                            return False
            if self.rec.capped:
                break
            self._check_unchanged(path, entry, "while it was read")
            self.finished.append({**entry, "sha256": None if self.arm.source is None else mf.sha256(path),
                                  "tokens": None, "documents": None, "_file": i})
            self.cursor = {"file": i + 1, "position": 0, "line": 1, "inner": 0}
            if self.file_delay:
                time.sleep(self.file_delay)
            if should_stop():
                self._flush(progress)
                self._commit()
                return False
        self._flush(progress)
        self.rec.complete = True
        self._commit(digests=True)
        return True

    def _check_unchanged(self, path: Path, entry: dict, when: str) -> None:
        if self.arm.source is None:
            return
        try:
            now = mf.stat_entry(path)
        except FileNotFoundError:
            raise DataError(f"{path}: the source file vanished during preparation (what is prepared is kept; "
                            f"restore the file, or delete the run's data/ to prepare afresh)") from None
        if (now["size"], now["mtime_ns"]) != (entry["size"], entry["mtime_ns"]):
            raise DataError(f"{path}: the source file changed {when} (what is prepared is kept; restore it, or "
                            f"delete the run's data/ to prepare afresh)")

    def _add(self, file_index: int, piece: read.Piece) -> None:
        data = piece.text.encode()
        if self.arm.cap and self.rec.text_bytes + len(data) > self.arm.cap:
            left = self.arm.cap - self.rec.text_bytes
            piece = read.Piece(data[:left].decode(errors="ignore"), piece.end, True)
            data = piece.text.encode()
            self.rec.capped = True
        self.rec.text_bytes += len(data)
        self.counts.literal_eot += piece.text.count(EOT)
        self.chunk.append((file_index, piece))
        self.chunk_bytes += len(data)

    def _flush(self, progress: ByteProgress) -> None:
        if self.chunk:
            encodings = self.codec.tokenizer.encode_batch_fast([p.text for _, p in self.chunk],
                                                                add_special_tokens=False)
            parts = []
            for (i, piece), enc in zip(self.chunk, encodings):
                parts.append(np.asarray(enc.ids, dtype=self.writer.dtype))
                tally = self.tally.setdefault(i, [0, 0])
                tally[0] += len(enc.ids)
                if piece.doc_end:
                    parts.append(np.asarray([self.codec.eot], dtype=self.writer.dtype))
                    tally[0] += 1
                    tally[1] += 1
                    self.rec.documents += 1
            del encodings
            self.writer.append(np.concatenate(parts))
        for rec in self.finished:
            rec["tokens"], rec["documents"] = self.tally.pop(rec.pop("_file"))
            if self.files is not None:
                self.files.add(rec)
            self.rec.files += 1
        self.finished.clear()
        read_now = min(self.counts.raw_bytes, self.file_size) if self.file_size else self.counts.raw_bytes
        progress.advance(self.done_bytes + read_now, self.writer.stream)
        self.chunk, self.chunk_bytes = [], 0

    def _commit(self, digests: bool = False) -> None:
        self.rec.train_tokens, self.rec.val_tokens = self.writer.commit()
        if digests:  # the arm is complete: its token files never change again; verify checks these
            self.rec.token_digests = {
                split: mf.token_digest(path, n * self.writer.dtype.itemsize)
                for split, path, n in zip(("train", "val"), self.writer.paths,
                                          (self.rec.train_tokens, self.rec.val_tokens))}
        self.rec.files_bytes = self.files.commit() if self.files is not None else 0
        tokens, documents = self.tally.get(self.cursor["file"], [0, 0])
        self.rec.cursor = {**self.cursor, "tokens": tokens, "documents": documents}
        self.rec.counts = self.counts.to_dict()
        self.save()  # the manifest only ever names bytes that are already durable
        self.hook.committed()
