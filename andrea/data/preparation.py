"""Preparing a run's data: sources read in pieces, encoded by HF `tokenizers` on all cores, appended to token files.

`prepare_run` is what `andrea prepare` and a run's first start call: it fixes each arm's file list (its plan),
trains or loads the tokenizer, records token arms, then runs one `ArmJob` (encode.py) per arm not yet complete.
Memory is one chunk of text and its tokens, whatever the corpus size. `should_stop` (a SIGTERM, Ctrl-C) is polled
between chunks, source files and every MiB of the tokenizer's sample: the preparation commits and raises
`Interrupted` within about a second.

Writes `tokenizer.json` (trained on a bounded sample: `TextArm.sample`) and `data/` (manifest.py lists its files).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np

from andrea.config.check import ConfigError
from andrea.config.corpus import DataConfig, SourceConfig
from andrea.data import manifest as mf, splits
from andrea.data.codec import EOT, TextCodec
from andrea.data.encode import ArmJob, CommitHook, Interrupted, TextArm
from andrea.data.sources import DataError, builtin_source_bytes, source_files
from andrea.data.tokentrain import train_tokenizer
from andrea.control.observe.progress import ByteProgress
from andrea.rundir.atomic import write_atomic
from andrea.rundir.names import DATA_DIR, TOKENIZER_NAME

log = logging.getLogger("andrea.data")

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
    path = run_dir / TOKENIZER_NAME
    sample_bytes = None
    if cfg.tokenizer != "bpe":
        path = Path(cfg.tokenizer).expanduser()
        codec = TextCodec.load(path)
        problem = codec.cut_problem()
        if problem:
            raise DataError(f"{path}: cannot prepare data with this tokenizer: {problem}")
    elif path.exists():
        codec = TextCodec.load(path)
    else:
        codec, sample_bytes, counts = train_tokenizer(arms, plans, cfg.tokenizer_sample_bytes, vocab_size,
                                                      should_stop)
        if sample_bytes == 0:  # a tokenizer of bytes alone would be kept and reused: refuse it
            why = _why(counts, arms)
            raise DataError(f"{', '.join(a.where for a in arms)}: the source is empty (no text to train the "
                            f"tokenizer on{': ' + why if why else ''})")
        write_atomic(path, codec.tokenizer.to_str().encode())
        log.info("data: tokenizer trained (vocab %d) on a %.1f MB sample of %d arm(s) (data.tokenizer_sample_bytes "
                 "= %.1f MB)", codec.vocab_size, sample_bytes / 1e6, len(arms), cfg.tokenizer_sample_bytes / 1e6)
    if codec.eot is None:
        raise DataError(f"{path}: tokenizer has no {EOT} token")
    if codec.vocab_size > vocab_size:
        raise DataError(f"{path}: tokenizer has {codec.vocab_size} tokens, more than model.vocab_size={vocab_size}")
    return codec, {"file": str(path) if cfg.tokenizer != "bpe" else TOKENIZER_NAME, "sha256": mf.sha256(path),
                   "vocab_size": codec.vocab_size, "sample_bytes": sample_bytes}


def _why(c: dict, arms: list[TextArm] = ()) -> str:
    """What a source held instead of text, in words (for "the source is empty")."""
    parts = [c.get("empty_files") and f"{c['empty_files']} empty file(s)",
             c.get("binary_files") and f"{c['binary_files']} binary file(s) skipped, first: {c['first_binary']}",
             c.get("skipped_records") and f"{c['skipped_records']} record(s) skipped, first: {c['first_skipped']}"]
    nested = [a.key for a in arms if a.kind in ("jsonl", "parquet") and "." in a.key]
    if c.get("skipped_records") and nested:
        parts.append(f"field {nested[0]!r} names a top-level key or column: nested fields are not read")
    return "; ".join(x for x in parts if x)


def anchor_paths(cfg: DataConfig, data_dir: Path) -> None:
    """A relative `path` of a source not prepared yet is made absolute against the working directory now, so that
    run.toml and the data manifest say where it is whatever directory a later start runs in. A source the
    manifest records keeps the path it was prepared from. `data.tokenizer`, when it names a file, is made
    absolute too, and a missing one is refused in one line (ConfigError) before the run directory is touched."""
    if cfg.tokenizer != "bpe":
        tokenizer = Path(cfg.tokenizer).expanduser().absolute()
        if not tokenizer.is_file():
            raise ConfigError(f"data.tokenizer = {cfg.tokenizer!r}: no such file ({tokenizer})")
        cfg.tokenizer = str(tokenizer)
    recorded = mf.Manifest.load(data_dir)
    for src in cfg.sources:
        path = Path(src.path).expanduser()
        if not path.is_absolute() and (recorded is None or src.name not in recorded.arms):
            src.path = str(path.absolute())


def check_unchanged(cfg: DataConfig, manifest: mf.Manifest | None) -> None:
    """Refuse a configuration that changes how a prepared arm was made: its tokens would not match it."""
    if manifest is None:
        return
    for src in cfg.sources:
        rec = manifest.arms.get(src.name)
        if rec is None:
            continue
        now = {"kind": src.kind, "field": src.field, "max_bytes": src.max_bytes} if src.kind != "tokens" else {
            "kind": src.kind, "dtype": src.dtype}
        was = {"kind": rec.kind, "field": rec.field, "max_bytes": rec.max_bytes, "dtype": rec.dtype}
        for key, value in now.items():
            if was[key] != value:
                raise DataError(f"data.sources[{src.name!r}].{key} = {value!r}, but the arm was prepared with "
                                f"{key} = {was[key]!r} ({manifest.path}): set it back, or give the source another "
                                f"name to prepare it anew")


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
    top, high_halves = 0, False  # uint32 ids read as uint16: every second value (the high half) is 0
    for i in range(0, len(tokens), 1 << 24):
        part = tokens[i:i + (1 << 24)]
        top = max(top, int(part.max()))
        high_halves = high_halves or bool(part[1 - i % 2::2].any())
    if src.dtype == "uint16" and not high_halves and len(tokens) >= 64 and len(tokens) % 2 == 0:
        raise DataError(f"{path}: every second uint16 is 0: this looks like a uint32 token file; set "
                        f"data.sources[{src.name!r}].dtype = 'uint32'")
    if top >= vocab_size:
        hint = (" (a uint16 file read as uint32 has such ids: is dtype = 'uint16'?)"
                if src.dtype == "uint32" and top >= 1 << 16 else "")
        raise DataError(f"{path}: token id {top} does not fit model.vocab_size={vocab_size}{hint}")
    entry = {**mf.stat_entry(path), "sha256": mf.sha256(path)}
    val = int(len(tokens) * cfg_val_fraction)  # the held-out tail (store.py keeps at least a block of it)
    return mf.ArmRecord(kind="tokens", source=str(path), complete=True, dtype=src.dtype, source_bytes=size,
                        counts={"file": {k: entry[k] for k in ("size", "mtime_ns", "sha256")}},
                        train_tokens=len(tokens) - val, val_tokens=val)


def prepare_run(cfg: DataConfig, run_dir: Path, vocab_size: int, *, should_stop: Callable[[], bool] = lambda: False,
                legacy: set[str] = frozenset()) -> tuple[TextCodec | None, mf.Manifest, bool]:
    """Prepare every configured arm not prepared yet (`legacy`: arms in a pre-manifest run's layout, kept as they
    are). Returns (codec, manifest, whether anything was done); raises Interrupted when asked to stop."""
    hook = CommitHook()  # a test hook; never stops in production
    asked = should_stop
    should_stop = lambda: asked() or hook()  # noqa: E731
    data_dir = run_dir / DATA_DIR
    loaded = mf.Manifest.load(data_dir)
    check_unchanged(cfg, loaded)
    data_dir.mkdir(parents=True, exist_ok=True)
    manifest = loaded or mf.Manifest(data_dir / mf.MANIFEST, val_fraction=cfg.val_fraction,
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
    # Plans are read (or fixed) only where they are used: by the arms to prepare, and by every arm when the
    # tokenizer is trained now (a prepared run's start reads none of them).
    training = cfg.tokenizer == "bpe" and not (run_dir / TOKENIZER_NAME).exists()
    sampled = [a for a in arms if a.name not in legacy] if training else []
    plans = {a.name: plan_for(a, data_dir) for a in [*sampled, *todo]}
    codec = None
    if arms:
        codec, info = tokenizer_for(cfg, run_dir, vocab_size, sampled, plans, should_stop)
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
                         manifest.val_fraction, manifest.save, hook)
            progress.base = base
            did = True
            log.info("data: preparing arm %r from %d source file(s), %s", arm.name, len(plan), _size_said(arm, plan))
            try:
                finished = job.run(should_stop, progress)
            except DataError:
                if record.documents == 0:  # failed before its first document (a wrong field or column): no trace,
                    _drop(manifest, arm)  # so the source fixed, or configured otherwise, is prepared anew
                raise
            if not finished:
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
    record = _drop(manifest, arm)
    why = _why(record.counts, [arm])
    raise DataError(f"{arm.where}: the source is empty" + (f" ({why})" if why else ""))


def _drop(manifest: mf.Manifest, arm: TextArm) -> mf.ArmRecord:
    """Remove an arm's record and files (it holds no document); returns the record."""
    record = manifest.arms.pop(arm.name)
    manifest.save()
    for suffix in ("plan.json", "files.jsonl", "train.u16", "val.u16", "train.u32", "val.u32"):
        (manifest.path.parent / f"{arm.name}.{suffix}").unlink(missing_ok=True)
    return record


def _source_bytes(plan: list[dict]) -> int | None:
    sizes = [e["size"] for e in plan]
    return None if None in sizes else sum(sizes)


def _expected_bytes(arm: TextArm, plan: list[dict]) -> int:
    total = sum(e["size"] or 0 for e in plan) or arm.cap
    return min(total, arm.cap) if arm.cap else total


def _size_said(arm: TextArm, plan: list[dict]) -> str:
    """The arm's size as known before it is read: its files' bytes (at most its cap), or only the cap when the
    sizes are unknown (an embedded arm): never the cap as if it were the size."""
    total = _source_bytes(plan)
    if total is None or total == 0:
        return f"up to {arm.cap / 1e6:.1f} MB (its cap)" if arm.cap else "size unknown until read"
    return f"{min(total, arm.cap) / 1e6:.1f} MB" + (f" (capped from {total / 1e6:.1f} MB)" if arm.cap and total > arm.cap else "")


def _report(arm: TextArm, rec: mf.ArmRecord) -> None:
    c = rec.counts
    if rec.capped:
        limit = "data.max_bytes_per_arm" if arm.source is None else f"data.sources[{arm.name!r}].max_bytes"
        of = f"of {rec.source_bytes / 1e6:.1f} MB" if rec.source_bytes else "of a larger source"
        log.info("data: arm %r capped by %s = %d: used %.1f MB of text %s", arm.name, limit, arm.cap,
                    rec.text_bytes / 1e6, of)
    if c.get("binary_files"):
        log.warning("data: arm %r: %d binary file(s) skipped (first: %s)", arm.name, c["binary_files"],
                    c["first_binary"])
    if c.get("literal_eot"):
        log.warning("data: arm %r: %d literal %s string(s) inside documents, encoded as text (not as the document "
                    "boundary)", arm.name, c["literal_eot"], EOT)
    if c.get("undecodable_bytes"):
        log.warning("data: arm %r: %d undecodable bytes replaced by U+FFFD", arm.name, c["undecodable_bytes"])
    if c.get("empty_files"):
        log.warning("data: arm %r: %d empty file(s) skipped (first: %s)", arm.name, c["empty_files"], c["first_empty"])
    if c.get("skipped_records"):
        log.warning("data: arm %r: %d record(s) skipped (first: %s)", arm.name, c["skipped_records"],
                    c["first_skipped"])
    log.info("data: arm %r prepared: %.1f MB of text, %d documents, %d train + %d val tokens", arm.name,
             rec.text_bytes / 1e6, rec.documents, rec.train_tokens, rec.val_tokens)
