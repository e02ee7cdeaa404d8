"""Encoding one text arm: its pieces (read.py) gathered into chunks, `encode_batch_fast`, appended to its files.

`ArmJob` runs one arm from its manifest record's cursor to the end of its sources (or its cap). Memory is one
chunk of text and its tokens: pieces are gathered into chunks of `CHUNK_BYTES`, each chunk goes through
`Tokenizer.encode_batch_fast` (parallel in Rust), and its tokens are appended to the arm's token files
(splits.py). Every `COMMIT_SECONDS`, at a stop request and at the arm's end, the token files and the arm's
`files.jsonl` are fsynced, and only then does the manifest (manifest.py) record how far the arm got: a later job
continues from there and ends with the same bytes as an uninterrupted one. `should_stop` is polled between chunks
and between source files.
Test hook: `ANDREA_TEST_FILE_DELAY=<seconds>` sleeps after each source file (a window for signals); never in
production.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea.config import SourceConfig
from andrea.data import manifest as mf, read, splits
from andrea.data.codec import TextCodec
from andrea.data.sources import DataError, builtin_documents
from andrea.progress import ByteProgress

CHUNK_BYTES = 2 << 20  # text per encode_batch call: ~1 s of encoding on two cores
COMMIT_SECONDS = 10.0
SAMPLE_FILE_BYTES = 1 << 16  # the tokenizer's sample takes at least this much from each file it visits


class Interrupted(Exception):
    """A stop request arrived during preparation; what is done is committed. The message says how far it got."""


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

    def pieces(self, path: Path, start: int, line: int, counts: read.Counts) -> Iterator[read.Piece]:
        if self.source is None:
            docs = read.Documents(builtin_documents(self.name), counts)
            return docs.pieces(start)
        return read.pieces(path, self.kind, self.key, start, counts, line)

    def sample(self, budget: int, plan: list[dict]) -> Iterator[str]:
        """The head of evenly spaced files, `budget` bytes of text in all (at most the cap)."""
        budget = min(budget, self.cap) if self.cap else budget
        m = max(1, min(len(plan), budget // SAMPLE_FILE_BYTES))
        per_file = budget // m
        for k in range(m):
            left = per_file
            for piece in self.pieces(Path(plan[k * len(plan) // m]["path"]), 0, 1, read.Counts()):
                data = piece.text.encode()
                yield data[:left].decode(errors="ignore") if len(data) > left else piece.text
                left -= len(data)
                if left <= 0:
                    break


class ArmJob:
    """Encodes one text arm from its record's cursor to the end (or the cap), committing as it goes."""

    def __init__(self, arm: TextArm, record: mf.ArmRecord, plan: list[dict], codec: TextCodec, dtype: np.dtype,
                 data_dir: Path, val_fraction: float, save: Callable[[], None]):
        self.arm, self.rec, self.plan, self.codec, self.save = arm, record, plan, codec, save
        ext = splits.suffix(dtype)
        self.writer = splits.SplitWriter(data_dir / f"{arm.name}.train.{ext}", data_dir / f"{arm.name}.val.{ext}",
                                         dtype, record.span, val_fraction, record.train_tokens, record.val_tokens)
        self.files = mf.FileLog(data_dir / f"{arm.name}.files.jsonl", record.files_bytes) if arm.source else None
        self.counts = read.Counts(**record.counts)
        self.chunk: list[tuple[int, read.Piece]] = []
        self.chunk_bytes = 0
        self.cursor = dict(record.cursor)
        # tokens and documents per file index, for its files.jsonl line; a resumed file starts from its cursor's
        self.tally: dict[int, list[int]] = {self.cursor["file"]: [self.cursor.get("tokens", 0),
                                                                 self.cursor.get("documents", 0)]}
        self.finished: list[dict] = []  # file records whose last piece is in the chunk
        self.file_delay = float(os.environ.get("ANDREA_TEST_FILE_DELAY", "0") or 0)  # test hook: slow files

    def run(self, should_stop: Callable[[], bool], progress: ByteProgress) -> bool:
        """True when the arm is complete; False when stopped (everything read so far committed)."""
        try:
            return self._run(should_stop, progress)
        except OSError as e:  # a full disk, a read-only mount: the last commit stays the valid state
            where = e.filename or self.writer.paths[0].parent
            raise DataError(f"{where}: cannot write the prepared data: {e.strerror or e} (everything committed "
                            f"before is kept; free space and run again to continue)") from None
        finally:
            self.writer.close()
            if self.files is not None:
                self.files.close()

    def _run(self, should_stop: Callable[[], bool], progress: ByteProgress) -> bool:
        last_commit = time.monotonic()
        for i in range(self.cursor["file"], len(self.plan)):
            entry = self.plan[i]
            path = Path(entry["path"])
            self._check_unchanged(path, entry, "since its preparation began")
            start, line = self.cursor["position"], self.cursor["line"]
            self.tally.setdefault(i, [0, 0])
            for piece in self.arm.pieces(path, start, line, self.counts):
                if self.arm.cap and self.rec.text_bytes >= self.arm.cap:
                    self.rec.capped = True
                    break
                self._add(i, piece)
                if piece.resumable:
                    self.cursor = {"file": i, "position": piece.end, "line": piece.line or 1}
                if self.chunk_bytes >= CHUNK_BYTES and piece.resumable:
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
            self.cursor = {"file": i + 1, "position": 0, "line": 1}
            if self.file_delay:
                time.sleep(self.file_delay)
            if should_stop():
                self._flush(progress)
                self._commit()
                return False
        self._flush(progress)
        self.rec.complete = True
        self._commit()
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
            piece = read.Piece(data[:left].decode(errors="ignore"), piece.end, True, False)
            data = piece.text.encode()
            self.rec.capped = True
        self.rec.text_bytes += len(data)
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
        progress.advance(self.counts.raw_bytes, self.writer.stream)
        self.chunk, self.chunk_bytes = [], 0

    def _commit(self) -> None:
        self.rec.train_tokens, self.rec.val_tokens = self.writer.commit()
        self.rec.files_bytes = self.files.commit() if self.files is not None else 0
        tokens, documents = self.tally.get(self.cursor["file"], [0, 0])
        self.rec.cursor = {**self.cursor, "tokens": tokens, "documents": documents}
        self.rec.counts = self.counts.to_dict()
        self.save()  # the manifest only ever names bytes that are already durable
