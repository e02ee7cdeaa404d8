"""Preparing a run's data: sources read in pieces, encoded by HF `tokenizers` on all cores, appended to token files.

`prepare_run` is what `andrea prepare` and a run's first start call. Memory is one chunk of text and its tokens,
whatever the corpus size: pieces (read.py) are gathered into chunks of `CHUNK_BYTES`, each chunk goes through
`Tokenizer.encode_batch_fast` (parallel in Rust), and its tokens are appended to the arm's files (splits.py). Every
`COMMIT_SECONDS`, at a stop request and at the end of an arm, the files are fsynced and then the manifest
(manifest.py) records how far the arm got; a later call continues from there and ends with the same bytes as an
uninterrupted preparation. `should_stop` (a SIGTERM, Ctrl-C) is polled between chunks and source files: the
preparation commits and raises `Interrupted` within a chunk's time (about a second).
Test hook: `ANDREA_TEST_FILE_DELAY=<seconds>` sleeps after each source file (a window for signals); never in
production.

Writes `tokenizer.json` (trained on a bounded sample: `TextArm.sample`) and `data/` (manifest.py lists its files).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from andrea.config import DataConfig, SourceConfig
from andrea.control.sidecars import write_atomic
from andrea.data import manifest as mf
from andrea.data import read, splits
from andrea.data.codec import EOT, TextCodec
from andrea.data.sources import DataError, builtin_documents, builtin_source_bytes, source_files
from andrea.progress import ByteProgress

log = logging.getLogger("andrea.data")

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


def text_arms(cfg: DataConfig) -> list[TextArm]:
    user = {s.name: s for s in cfg.sources}
    out = []
    for name in cfg.arm_names():
        s = user.get(name)
        if s is None:
            out.append(TextArm(name, "builtin", "text", cfg.max_bytes_per_arm, None))
        elif s.kind != "tokens":
            out.append(TextArm(name, s.kind, s.field, s.max_bytes, s))
    return out


def plan_for(arm: TextArm, data_dir: Path) -> list[dict]:
    """The arm's file list as fixed when its preparation began (so a resume reads the same files in order)."""
    path = data_dir / f"{arm.name}.plan.json"
    if path.exists():
        return mf.read_plan(path)
    if arm.source is None:  # the interpreter's own library: nothing to record per file
        return [{"path": arm.name, "size": builtin_source_bytes(arm.name), "mtime_ns": 0}]
    return mf.write_plan(path, source_files(arm.source))


# --- the tokenizer -------------------------------------------------------------------------------------------
def tokenizer_for(cfg: DataConfig, run_dir: Path, vocab_size: int, arms: list[TextArm],
                  plans: dict[str, list[dict]], should_stop: Callable[[], bool]) -> tuple[TextCodec, dict]:
    """The run's tokenizer: the configured file, the run's own, or one trained now on a sample of the arms."""
    path = run_dir / "tokenizer.json"
    sample_bytes = None
    if cfg.tokenizer != "bpe":
        path = Path(cfg.tokenizer).expanduser()
        codec = TextCodec.load(path)
    elif path.exists():
        codec = TextCodec.load(path)
    else:
        per_arm = cfg.tokenizer_sample_bytes // len(arms)
        texts = (t for arm in arms for t in arm.sample(per_arm, plans[arm.name]))
        counted = _Counted(texts, should_stop)
        codec = TextCodec.train(counted, vocab_size)
        if counted.bytes == 0:  # a tokenizer of bytes alone would be kept and reused: refuse it
            raise DataError(f"{', '.join(a.where for a in arms)}: the source is empty (no text to train the "
                            f"tokenizer on)")
        write_atomic(path, codec.tokenizer.to_str().encode())
        sample_bytes = counted.bytes
        log.info("data: tokenizer trained (vocab %d) on a %.1f MB sample of %d arm(s) (data.tokenizer_sample_bytes)",
                 codec.vocab_size, sample_bytes / 1e6, len(arms))
    if codec.eot is None:
        raise DataError(f"{path}: tokenizer has no {EOT} token")
    if codec.vocab_size > vocab_size:
        raise DataError(f"{path}: tokenizer has {codec.vocab_size} tokens, more than model.vocab_size={vocab_size}")
    return codec, {"file": str(path) if cfg.tokenizer != "bpe" else "tokenizer.json", "sha256": mf.sha256(path),
                   "vocab_size": codec.vocab_size, "sample_bytes": sample_bytes}


class _Counted:
    """The sample as the trainer reads it: its size counted, a stop request polled every MiB of it (~a second)."""

    def __init__(self, texts: Iterator[str], should_stop: Callable[[], bool]):
        self.texts, self.should_stop, self.bytes = texts, should_stop, 0

    def __iter__(self):
        polled = 0
        for t in self.texts:
            if self.bytes - polled >= 1 << 20:
                polled = self.bytes
                if self.should_stop():
                        raise Interrupted("data: preparation stopped while training the tokenizer; nothing is kept "
                                      "yet: run `andrea prepare` or `andrea train` again to start it over")
            self.bytes += len(t.encode())
            yield t


# --- one arm ---------------------------------------------------------------------------------------------------
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


# --- the run ---------------------------------------------------------------------------------------------------
def token_record(src: SourceConfig, vocab_size: int, cfg_val_fraction: float) -> mf.ArmRecord:
    """A token arm, checked once (its width, its largest id) and recorded with its provenance."""
    files = source_files(src)
    if len(files) != 1:
        raise DataError(f"data.sources[{src.name!r}].path: a token source must be one file, {len(files)} match")
    path, width = files[0], np.dtype(src.dtype).itemsize
    size = path.stat().st_size
    if size < 2 * width or size % width:
        raise DataError(f"{path}: not a {src.dtype} token file ({size} bytes)")
    tokens = np.memmap(path, dtype=np.dtype(src.dtype).newbyteorder("<"), mode="r")
    top = max(int(tokens[i:i + (1 << 24)].max()) for i in range(0, len(tokens), 1 << 24))
    if top >= vocab_size:
        raise DataError(f"{path}: token id {top} does not fit model.vocab_size={vocab_size}")
    entry = {**mf.stat_entry(path), "sha256": mf.sha256(path)}
    val = int(len(tokens) * cfg_val_fraction)  # the held-out tail (store.py keeps at least a block of it)
    return mf.ArmRecord(kind="tokens", source=str(path), complete=True, dtype=src.dtype, source_bytes=size,
                        counts={"file": {k: entry[k] for k in ("size", "mtime_ns", "sha256")}},
                        train_tokens=len(tokens) - val, val_tokens=val)


def prepare_run(cfg: DataConfig, run_dir: Path, vocab_size: int, *, should_stop: Callable[[], bool] = lambda: False,
                legacy: set[str] = frozenset()) -> tuple[TextCodec | None, mf.Manifest, bool]:
    """Prepare every configured arm not prepared yet (`legacy`: arms in a pre-manifest run's layout, kept as they
    are). Returns (codec, manifest, whether anything was done); raises Interrupted when asked to stop."""
    data_dir = run_dir / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    manifest = mf.Manifest.load(data_dir) or mf.Manifest(data_dir / mf.MANIFEST, val_fraction=cfg.val_fraction,
                                                         dtype=str(np.dtype(splits.token_dtype(vocab_size)).name))
    arms = text_arms(cfg)
    todo = [a for a in arms if a.name not in legacy and not (a.name in manifest.arms and
                                                             manifest.arms[a.name].complete)]
    did = False
    for src in cfg.sources:
        if src.kind == "tokens" and src.name not in manifest.arms:
            manifest.arms[src.name] = token_record(src, vocab_size, cfg.val_fraction)
            manifest.save()
            did = True
    codec, plans = None, {a.name: plan_for(a, data_dir) for a in arms if a.name not in legacy}
    if arms:
        codec, info = tokenizer_for(cfg, run_dir, vocab_size, [a for a in arms if a.name in plans], plans,
                                    should_stop)
        if manifest.tokenizer and manifest.tokenizer.get("sha256") != info["sha256"]:
            raise DataError(f"{manifest.path}: prepared with another tokenizer (sha256 "
                            f"{manifest.tokenizer['sha256'][:12]}…, now {info['sha256'][:12]}…)")
        if not manifest.tokenizer:
            manifest.tokenizer = info
            manifest.save()
    total = sum(_expected_bytes(a, plans[a.name]) for a in todo)
    progress = ByteProgress(total, "prepare")
    base = 0
    try:
        for arm in todo:
            plan = plans[arm.name]
            record = manifest.arms.get(arm.name)
            if record is None:
                record = mf.ArmRecord(kind=arm.kind, source=str(arm.source.path) if arm.source else "built-in",
                                      field=arm.key, max_bytes=arm.cap,
                                      span=splits.span_for(_expected_bytes(arm, plan)),
                                      source_bytes=_source_bytes(plan))
                manifest.arms[arm.name] = record
                manifest.save()  # before the token files exist: a file without a record is a pre-manifest run's
            job = ArmJob(arm, record, plan, codec, np.dtype(splits.token_dtype(vocab_size)), data_dir,
                         manifest.val_fraction, manifest.save)
            progress.base = base
            did = True
            log.info("data: preparing arm %r from %d source file(s), %.1f MB", arm.name, len(plan),
                     _expected_bytes(arm, plan) / 1e6)
            if not job.run(should_stop, progress):
                done = sum(a.text_bytes for a in manifest.arms.values() if a.kind != "tokens")
                raise Interrupted(f"data: preparation stopped at arm {arm.name!r}, file {record.cursor['file'] + 1} "
                                  f"of {len(plan)}; {done / 1e6:.1f} MB of text encoded and kept: run `andrea "
                                  f"prepare` or `andrea train` again to continue")
            base += _expected_bytes(arm, plan)
            _report(arm, record)
            if record.documents == 0:
                _forget(manifest, arm)
    finally:
        progress.close()
    return codec, manifest, did


def _forget(manifest: mf.Manifest, arm: TextArm) -> None:
    """An arm with no document: no trace is left (so a source fixed later is prepared anew), and one error line."""
    record = manifest.arms.pop(arm.name)
    manifest.save()
    for suffix in ("plan.json", "files.jsonl", "train.u16", "val.u16", "train.u32", "val.u32"):
        (manifest.path.parent / f"{arm.name}.{suffix}").unlink(missing_ok=True)
    c = record.counts
    why = "; ".join(x for x in (c.get("empty_files") and f"{c['empty_files']} empty file(s)",
                                c.get("skipped_records") and f"{c['skipped_records']} record(s) skipped, first: "
                                f"{c['first_skipped']}") if x)
    raise DataError(f"{arm.where}: the source is empty" + (f" ({why})" if why else ""))


def _source_bytes(plan: list[dict]) -> int | None:
    sizes = [e["size"] for e in plan]
    return None if None in sizes else sum(sizes)


def _expected_bytes(arm: TextArm, plan: list[dict]) -> int:
    total = sum(e["size"] or 0 for e in plan) or arm.cap
    return min(total, arm.cap) if arm.cap else total


def _report(arm: TextArm, rec: mf.ArmRecord) -> None:
    c = rec.counts
    if rec.capped:
        limit = "data.max_bytes_per_arm" if arm.source is None else f"data.sources[{arm.name!r}].max_bytes"
        of = f"of {rec.source_bytes / 1e6:.1f} MB" if rec.source_bytes else "of a larger source"
        log.warning("data: arm %r capped by %s = %d: used %.1f MB of text %s", arm.name, limit, arm.cap,
                    rec.text_bytes / 1e6, of)
    if c.get("undecodable_bytes"):
        log.warning("data: arm %r: %d undecodable bytes replaced by U+FFFD", arm.name, c["undecodable_bytes"])
    if c.get("empty_files"):
        log.warning("data: arm %r: %d empty file(s) skipped (first: %s)", arm.name, c["empty_files"], c["first_empty"])
    if c.get("skipped_records"):
        log.warning("data: arm %r: %d record(s) skipped (first: %s)", arm.name, c["skipped_records"],
                    c["first_skipped"])
    log.info("data: arm %r prepared: %d documents, %d train + %d val tokens", arm.name, rec.documents,
             rec.train_tokens, rec.val_tokens)
