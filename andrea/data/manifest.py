"""The preparation's record under `data/`: what each arm was made from, how far it got, what it holds.

Writes (each atomically: temporary file, fsync, rename, directory fsync):
    data/manifest.json       {"format": 1,
                              "tokenizer": {"file", "sha256", "vocab_size", "sample_bytes"},
                              "dtype": "uint16" | "uint32", "val_fraction": float,
                              "arms": {name: ArmRecord as a dict (below)}}
    data/<arm>.plan.json     the arm's source files as listed when its preparation began, in reading order:
                             [{"path", "size", "mtime_ns"}] (a resumed preparation reads exactly these)
    data/<arm>.files.jsonl   one line per source file finished: {"path", "size", "mtime_ns", "sha256", "tokens",
                             "documents"}; appended, and cut back to the manifest's `files_bytes` on resume
A complete arm records `token_digests`, the xxh3-128 of each of its token files' committed bytes, so `andrea
verify` sees a token changed after preparation (`verify_tokens`). An arm is used for training only once its
record says `complete`; until then `cursor` says where the next
piece starts (file index in the plan, position in that file, line number for JSON lines) and `train_tokens` /
`val_tokens` how much of the token files is committed (splits.py). Token arms (`kind = "tokens"`) are used in place:
their record names the file, its size, mtime, hash and token count.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import xxhash

from andrea.data.sources import DataError
from andrea.rundir import regular
from andrea.rundir.atomic import write_atomic
from andrea.rundir.jsonfile import read_json
from andrea.rundir.names import ARCHIVE_DIR, CONFIG_NAME, DATA_DIR, MANIFEST_NAME, STATE_NAME

FORMAT = 1
MANIFEST = MANIFEST_NAME


@dataclass
class ArmRecord:
    kind: str
    source: str  # the configured path, or "built-in"
    field: str = "text"
    max_bytes: int = 0  # the cap that applied (0: none)
    span: int = 0  # splits.py: tokens per train/val span
    complete: bool = False
    cursor: dict = dataclasses.field(default_factory=lambda: {"file": 0, "position": 0, "line": 1})
    train_tokens: int = 0
    val_tokens: int = 0
    documents: int = 0
    text_bytes: int = 0  # UTF-8 bytes of text encoded
    source_bytes: int | None = 0  # bytes of the source files (compressed size for .gz/.zst); None if unknown
    files: int = 0  # source files finished
    files_bytes: int = 0  # committed length of <arm>.files.jsonl
    capped: bool = False  # the cap stopped the arm before its source ended
    counts: dict = dataclasses.field(default_factory=dict)  # read.Counts: undecodable bytes, empty files, skips
    dtype: str = "uint16"  # token arms: the file's token width
    token_digests: dict = dataclasses.field(default_factory=dict)  # {"train", "val"}: xxh3-128 of the committed
    # tokens of each file, recorded when the arm completes (an arm prepared before this is unverifiable)

    @classmethod
    def from_dict(cls, d: dict, where: str) -> "ArmRecord":
        try:
            return cls(**d)
        except TypeError as e:
            raise DataError(f"{where}: not an andrea data manifest: {e}") from None


@dataclass
class Manifest:
    path: Path
    tokenizer: dict = dataclasses.field(default_factory=dict)
    dtype: str = "uint16"
    val_fraction: float = 0.05
    arms: dict[str, ArmRecord] = dataclasses.field(default_factory=dict)

    @classmethod
    def load(cls, data_dir: Path) -> "Manifest | None":
        path = data_dir / MANIFEST
        d = read_json(path, DataError, unreadable="cannot read the data manifest: {e}")
        if d is None:
            return None
        if not isinstance(d, dict) or d.get("format") != FORMAT or not isinstance(d.get("arms"), dict):
            raise DataError(f"{path}: not an andrea data manifest (format {FORMAT})")
        arms = {name: ArmRecord.from_dict(a, str(path)) for name, a in d["arms"].items()}
        return cls(path, d.get("tokenizer", {}), d.get("dtype", "uint16"), d.get("val_fraction", 0.05), arms)

    def save(self) -> None:
        body = {"format": FORMAT, "tokenizer": self.tokenizer, "dtype": self.dtype, "val_fraction": self.val_fraction,
                "arms": {name: asdict(a) for name, a in self.arms.items()}}
        write_atomic(self.path, (json.dumps(body, indent=1) + "\n").encode())


def sha256(path: Path) -> str:
    with regular.open_file(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def stat_entry(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def write_plan(path: Path, files: list[Path]) -> list[dict]:
    plan = [stat_entry(f) for f in files]
    write_atomic(path, json.dumps(plan).encode())
    return plan


def read_plan(path: Path) -> list[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: cannot read the preparation plan: {e}") from None


class FileLog:
    """`<arm>.files.jsonl`: records of finished source files, made durable at each commit."""

    def __init__(self, path: Path, committed: int):
        self.path = path
        self.f = open(path, "r+b" if path.exists() else "w+b")
        self.f.truncate(committed)  # lines after the last commit belong to files that will be read again
        self.f.seek(0, os.SEEK_END)

    def add(self, record: dict) -> None:
        self.f.write((json.dumps(record) + "\n").encode())

    def commit(self) -> int:
        self.f.flush()
        os.fsync(self.f.fileno())
        return self.f.tell()

    def close(self) -> None:
        self.f.close()


def drift(data_dir: Path, name: str, record: ArmRecord) -> list[str]:
    """Source files of a complete arm that changed or vanished since they were prepared ("path: gone")."""
    if record.kind == "tokens":
        entries = [{"path": record.source, **record.counts.get("file", {})}]
    else:
        log = data_dir / f"{name}.files.jsonl"
        if not log.exists():
            return []
        entries = [json.loads(line) for line in log.read_text().splitlines() if line]
    out = []
    for e in entries:
        try:
            st = os.stat(e["path"])
        except OSError:
            out.append(f"{e['path']}: gone")
            continue
        if "size" in e and (st.st_size != e["size"] or st.st_mtime_ns != e["mtime_ns"]):
            out.append(f"{e['path']}: changed")
    return out


def summary(record: ArmRecord) -> dict:
    """The `status` view of one arm."""
    return {"kind": record.kind, "complete": record.complete, "train_tokens": record.train_tokens,
            "val_tokens": record.val_tokens, "source_bytes": record.source_bytes, "text_bytes": record.text_bytes,
            "documents": record.documents, "capped": record.capped,
            **{k: v for k, v in record.counts.items() if k != "file" and v}}


def data_status(run_dir: Path) -> dict | None:
    """`status`'s "data": per arm its tokens, source bytes and the epochs drawn so far; None before preparation.

    Epochs = rows drawn × block_size / train tokens, rows from the bandit's pulls in `.state.json` and in every
    archived phase's (a pivot resets the bandit, not what the run has read); they lag by a window or two."""
    manifest = Manifest.load(run_dir / DATA_DIR)
    if manifest is None:
        return None
    try:
        import tomllib
        block = tomllib.loads(regular.read_text(run_dir / CONFIG_NAME))["model"]["block_size"]
    except (OSError, ValueError, KeyError):
        block = None
    pulls: dict[str, int] = {}
    for state in [run_dir / STATE_NAME, *sorted((run_dir / ARCHIVE_DIR).glob(f"phase-*/{STATE_NAME}"))]:
        try:
            arms = json.loads(regular.read_text(state))["bandit"]["arms"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for name, a in arms.items() if isinstance(arms, dict) else ():
            pulls[name] = pulls.get(name, 0) + int(a.get("pulls", 0))
    out = {}
    for name, rec in manifest.arms.items():
        s = summary(rec)
        drawn = pulls.get(name, 0) * block if block else None
        s["epochs"] = round(drawn / rec.train_tokens, 4) if drawn is not None and rec.train_tokens else None
        out[name] = s
    return out


def token_digest(path: Path, nbytes: int) -> str:
    """xxh3-128 of the first `nbytes` bytes of a token file (the recorded length: a file grown later still
    verifies what the run reads)."""
    h, left = xxhash.xxh3_128(), nbytes
    with regular.open_file(path) as f:
        while left and (piece := f.read(min(left, 16 << 20))):
            h.update(piece)
            left -= len(piece)
    if left:
        raise DataError(f"{path}: shorter than the {nbytes:,} bytes its manifest records")
    return h.hexdigest()


def verify_tokens(run_dir: Path) -> list[tuple[str, str, str]]:
    """(status, file, detail) per token file and the tokenizer of a prepared run, checked against its manifest:
    status "ok", "bad" (changed after preparation; detail says how) or "unverifiable" (prepared before digests
    were recorded)."""
    data_dir = run_dir / DATA_DIR
    manifest = Manifest.load(data_dir)
    out = []
    want = manifest.tokenizer.get("sha256")
    tok = run_dir / manifest.tokenizer.get("file", "tokenizer.json")
    if want and tok.parent == run_dir:
        got = sha256(tok) if tok.exists() else None
        out.append(("ok" if got == want else "bad", str(tok),
                    "sha256 matches the manifest" if got == want else
                    "missing" if got is None else f"sha256 {got[:16]}… differs from the manifest's {want[:16]}…"))
    itemsize = 2 if manifest.dtype == "uint16" else 4
    for name, rec in sorted(manifest.arms.items()):
        if rec.kind == "tokens" or not rec.complete:
            continue
        ext = "u16" if itemsize == 2 else "u32"
        for split, tokens in (("train", rec.train_tokens), ("val", rec.val_tokens)):
            path = data_dir / f"{name}.{split}.{ext}"
            recorded = rec.token_digests.get(split)
            if recorded is None:
                out.append(("unverifiable", str(path), "prepared before token digests were recorded"))
                continue
            try:
                got = token_digest(path, tokens * itemsize)
            except (OSError, DataError) as e:
                out.append(("bad", str(path), str(e)))
                continue
            out.append(("ok" if got == recorded else "bad", str(path), f"{tokens:,} tokens" if got == recorded
                        else f"its tokens changed after preparation (xxh3_128 {got}, recorded {recorded})"))
    return out
