"""prepare.py in-process: nothing cut, the split a pure function of position, resume byte-identical, bad input."""

from __future__ import annotations

import errno
import gzip
import hashlib
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from andrea.config.corpus import DataConfig, SourceConfig
from andrea.data import manifest as mf
from andrea.data import encode, read, splits, store, tokentrain
from andrea.data.codec import TextCodec
from andrea.data.preparation import Interrupted, prepare_run
from andrea.data.sources import DataError, source_files
from tests.unit.data.conftest import text
from tests.oscalls import OsCalls

VOCAB, BLOCK = 512, 16


def config(*sources: SourceConfig, **data) -> DataConfig:
    return DataConfig(arms=[], sources=list(sources), **data)


def corpus_arms(corpus, records):
    return (SourceConfig("notes", str(corpus)),
            SourceConfig("scrape", str(records / "*.jsonl*"), kind="jsonl", field="body"))


def whole_documents(src: SourceConfig) -> list[str]:
    """The source's documents read the plain way, whole (the independent reference)."""
    import zstandard
    out = []
    for f in source_files(src):
        raw = f.read_bytes()
        raw = gzip.decompress(raw) if f.name.endswith(".gz") else raw
        raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw) if f.name.endswith(".zst") else raw
        if src.kind == "text":
            out.append(raw.decode())
            continue
        for line in raw.decode().splitlines():
            try:
                body = json.loads(line).get(src.field)
            except ValueError:
                continue
            if isinstance(body, str) and body:
                out.append(body)
    return out


def files_of(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / "data").iterdir()) if p.name != mf.MANIFEST} | {
        "tokenizer.json": (run_dir / "tokenizer.json").read_bytes()}


def test_every_document_is_prepared_whole_and_the_split_depends_only_on_position(corpus, records, tmp_path):
    cfg = config(*corpus_arms(corpus, records))
    codec, arms = store.prepare(cfg, tmp_path, VOCAB, BLOCK)
    manifest = mf.Manifest.load(tmp_path / "data")
    for src, arm in zip(cfg.sources, arms):
        docs = whole_documents(src)
        stream = np.concatenate([np.append(codec.encode(d), codec.eot) for d in docs]).astype(np.uint16)
        rec = manifest.arms[src.name]
        train, val = splits.split_reference(stream, rec.span, cfg.val_fraction)
        assert np.array_equal(arm.train, train) and np.array_equal(arm.val, val), src.name  # no token lost or moved
        assert isinstance(arm.train, np.memmap)  # a trainer's memory does not hold the corpus
        assert rec.complete and not rec.capped and rec.documents == len(docs)
        assert 0.03 < len(val) / len(stream) < 0.07  # val_fraction 0.05 over the spans
        logged = [json.loads(line) for line in (tmp_path / "data" / f"{src.name}.files.jsonl").read_text().splitlines()]
        assert [e["path"] for e in logged] == [str(f) for f in source_files(src)]
        assert sum(e["tokens"] for e in logged) == len(stream)
        assert all(e["sha256"] == hashlib.sha256(Path(e["path"]).read_bytes()).hexdigest() for e in logged)
    assert ".hidden" not in " ".join(str(f) for f in source_files(cfg.sources[0]))
    assert manifest.tokenizer["sha256"] == hashlib.sha256((tmp_path / "tokenizer.json").read_bytes()).hexdigest()


def test_interrupted_many_times_and_killed_between_ends_byte_identical(corpus, records, tmp_path, monkeypatch):
    monkeypatch.setattr(encode, "CHUNK_BYTES", 16_384)  # many chunks, so stops land everywhere
    monkeypatch.setattr(read, "SEGMENT_BYTES", 4096)
    monkeypatch.setattr(tokentrain, "IN_PROCESS_BYTES", 1 << 30)  # stops counted in polls, not in seconds
    cfg = config(*corpus_arms(corpus, records))
    straight = tmp_path / "straight"
    prepare_run(cfg, straight, VOCAB)
    resumed = tmp_path / "resumed"
    mid_file = 0  # stops inside a file (a resumed reader), not only between files
    for attempt in range(300):  # bounded: each attempt makes progress
        polls = iter(range(attempt % 7 + 1))
        try:
            prepare_run(cfg, resumed, VOCAB, should_stop=lambda: next(polls, None) is None)
            break
        except Interrupted as e:
            assert "run `andrea prepare` or `andrea train` again to" in str(e)
        manifest = mf.Manifest.load(resumed / "data")  # None: stopped while the tokenizer trained
        open_arms = {n: a for n, a in (manifest.arms.items() if manifest else ()) if not a.complete}
        mid_file += any(a.cursor["position"] > 0 for a in open_arms.values())
        for name in open_arms:  # what a SIGKILL after a write leaves behind in the files of the arm in progress
            for leftover in (resumed / "data").glob(f"{name}.*.u16"):
                with open(leftover, "ab") as f:
                    f.write(b"\x01\x02" * 33)
            with open(resumed / "data" / f"{name}.files.jsonl", "a") as f:
                f.write('{"path": "half a li')
    else:
        pytest.fail("the preparation never completed")
    assert attempt >= 10 and mid_file >= 3, (attempt, mid_file)
    assert files_of(resumed) == files_of(straight)
    assert mf.Manifest.load(resumed / "data").arms.keys() == mf.Manifest.load(straight / "data").arms.keys()


def test_a_second_preparation_does_nothing_and_a_changed_source_is_one_warning(corpus, tmp_path, caplog):
    src = tmp_path / "src"
    shutil.copytree(corpus, src)
    cfg = config(SourceConfig("notes", str(src)))
    _, _, did = prepare_run(cfg, tmp_path / "run", VOCAB)
    assert did
    before = files_of(tmp_path / "run")
    _, _, did = prepare_run(cfg, tmp_path / "run", VOCAB)
    assert not did and files_of(tmp_path / "run") == before
    (src / "doc1.txt").write_text("rewritten")
    (src / "doc2.txt").unlink()
    with caplog.at_level(logging.WARNING, logger="andrea.data"):
        _, arms = store.prepare(cfg, tmp_path / "run", VOCAB, BLOCK)
    [line] = [r.getMessage() for r in caplog.records if "changed or gone" in r.getMessage()]
    assert "2 source file(s) changed or gone" in line and "training continues on the prepared tokens" in line
    assert files_of(tmp_path / "run") == before and len(arms[0].train) > 0


def test_a_cap_applies_only_when_set_and_says_how_much_of_how_much(corpus, tmp_path, caplog):
    cfg = config(SourceConfig("notes", str(corpus), max_bytes=100_000))
    with caplog.at_level(logging.INFO, logger="andrea.data"):
        prepare_run(cfg, tmp_path, VOCAB)
    rec = mf.Manifest.load(tmp_path / "data").arms["notes"]
    assert rec.capped and rec.text_bytes == 100_000 and rec.source_bytes > 100_000
    [capped] = [r for r in caplog.records if "capped by" in r.getMessage()]
    line = capped.getMessage()
    assert "data.sources['notes'].max_bytes = 100000" in line and f"of {rec.source_bytes / 1e6:.1f} MB" in line
    assert capped.levelno == logging.INFO  # a cap is the operator's setting doing its job: no warning
    [preparing] = [r.getMessage() for r in caplog.records if "preparing arm" in r.getMessage()]
    assert preparing.endswith(f"0.1 MB (capped from {rec.source_bytes / 1e6:.1f} MB)"), preparing


def test_an_arm_of_unknown_size_is_said_up_to_its_cap_never_as_its_size():
    from andrea.data import preparation
    arm = type("Arm", (), {"cap": 8_000_000})()
    assert preparation._size_said(arm, [{"size": None}]) == "up to 8.0 MB (its cap)"
    assert preparation._size_said(arm, [{"size": 1_700_000}]) == "1.7 MB"


def test_the_tokenizer_trains_on_a_bounded_deterministic_sample(corpus, records, tmp_path):
    cfg = config(*corpus_arms(corpus, records), tokenizer_sample_bytes=40_000)
    for run in ("a", "b"):
        prepare_run(cfg, tmp_path / run, VOCAB)
    sample = mf.Manifest.load(tmp_path / "a" / "data").tokenizer["sample_bytes"]
    assert 20_000 < sample <= 40_000
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    given = config(*corpus_arms(corpus, records), tokenizer=str(tmp_path / "a" / "tokenizer.json"))
    prepare_run(given, tmp_path / "c", VOCAB)  # an existing tokenizer.json is used as it is
    assert not (tmp_path / "c" / "tokenizer.json").exists()
    assert files_of(tmp_path / "a")["notes.train.u16"] == (tmp_path / "c" / "data" / "notes.train.u16").read_bytes()


def test_wide_vocabularies_use_uint32_files_and_token_arms_are_checked(corpus, tmp_path):
    ids = np.arange(69_000, 70_000, dtype=np.uint32).repeat(3)
    ids.tofile(tmp_path / "wide.bin")
    cfg = config(SourceConfig("notes", str(corpus / "doc5.txt")),
                 SourceConfig("wide", str(tmp_path / "wide.bin"), kind="tokens", dtype="uint32"))
    _, arms = store.prepare(cfg, tmp_path / "run", 70_000, BLOCK)
    assert (tmp_path / "run" / "data" / "notes.train.u32").exists() and arms[0].train.dtype == np.uint32
    assert arms[1].train.dtype == np.uint32 and int(arms[1].val.max()) == 69_999
    with pytest.raises(DataError, match=f"^{tmp_path / 'wide.bin'}: token id 69999 does not fit model.vocab_size="):
        store.prepare(config(cfg.sources[1]), tmp_path / "small", 65_000, BLOCK)


def test_a_source_vanishing_mid_preparation_is_one_error_and_the_rerun_completes(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(encode, "CHUNK_BYTES", 16_384)
    src = tmp_path / "src"
    shutil.copytree(corpus, src)
    cfg = config(SourceConfig("notes", str(src)))
    prepare_run(config(SourceConfig("notes", str(corpus))), tmp_path / "straight", VOCAB)
    last = source_files(cfg.sources[0])[-1]
    saved = last.read_bytes()

    def vanish():
        last.unlink(missing_ok=True)
        return False

    with pytest.raises(DataError, match=f"^{last}: the source file vanished during preparation"):
        prepare_run(cfg, tmp_path / "run", VOCAB, should_stop=vanish)
    last.write_bytes(saved)
    import os
    os.utime(last, ns=(mf.read_plan(tmp_path / "run" / "data" / "notes.plan.json")[-1]["mtime_ns"],) * 2)
    prepare_run(cfg, tmp_path / "run", VOCAB)
    got, want = files_of(tmp_path / "run"), files_of(tmp_path / "straight")
    assert got["notes.train.u16"] == want["notes.train.u16"] and got["notes.val.u16"] == want["notes.val.u16"]


def test_a_full_disk_is_one_error_naming_the_file_and_keeps_every_commit(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(encode, "CHUNK_BYTES", 16_384)
    monkeypatch.setattr(encode, "COMMIT_SECONDS", 0.0)  # commit after every chunk
    monkeypatch.setattr(read, "SEGMENT_BYTES", 4096)
    cfg = config(SourceConfig("notes", str(corpus)))
    prepare_run(cfg, tmp_path / "straight", VOCAB)
    appended = 0
    real = splits.SplitWriter.append

    def fill_up(self, tokens):
        nonlocal appended
        appended += 1
        if appended == 12:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.paths[0]))
        return real(self, tokens)

    monkeypatch.setattr(splits.SplitWriter, "append", fill_up)
    run = tmp_path / "run"
    with pytest.raises(DataError, match=f"^{run / 'data' / 'notes.train.u16'}: cannot write the prepared data: "
                                        "No space left on device"):
        prepare_run(cfg, run, VOCAB)
    committed = mf.Manifest.load(run / "data").arms["notes"]
    assert committed.train_tokens > 0 and not committed.complete
    monkeypatch.setattr(splits.SplitWriter, "append", real)
    prepare_run(cfg, run, VOCAB)
    assert files_of(run) == files_of(tmp_path / "straight")


def test_token_files_are_durable_before_the_manifest_that_counts_them(corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(encode, "CHUNK_BYTES", 16_384)
    monkeypatch.setattr(encode, "COMMIT_SECONDS", 0.0)
    cfg = config(SourceConfig("notes", str(corpus)))
    data = tmp_path / "data"
    with OsCalls() as calls:
        prepare_run(cfg, tmp_path, VOCAB)
    rec = mf.Manifest.load(data).arms["notes"]
    rename, _ = calls.published(data / mf.MANIFEST)  # the last manifest: rename, then its directory fsync
    calls.durable_before(data / "notes.train.u16", rename, min_size=2 * rec.train_tokens)
    calls.durable_before(data / "notes.val.u16", rename, min_size=2 * rec.val_tokens)
    calls.durable_before(data / "notes.files.jsonl", rename, min_size=rec.files_bytes)


def test_an_empty_source_is_one_error_naming_why_and_leaves_nothing_behind(tmp_path, records):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("")
    cfg = config(SourceConfig("blank", str(tmp_path / "src")))
    with pytest.raises(DataError, match=r"^data.sources\['blank'\] \(.*src\): the source is empty \(no text"):
        store.prepare(cfg, tmp_path / "run", VOCAB, BLOCK)  # a fresh run: no tokenizer trained on nothing
    assert not (tmp_path / "run" / "tokenizer.json").exists()
    TextCodec.train([text(1, 100)], VOCAB).tokenizer.save(str(tmp_path / "run" / "tokenizer.json"))
    with pytest.raises(DataError, match=r"^data.sources\['blank'\] \(.*src\): the source is empty \(1 empty file"):
        store.prepare(cfg, tmp_path / "run", VOCAB, BLOCK)
    assert "blank" not in mf.Manifest.load(tmp_path / "run" / "data").arms
    assert not list((tmp_path / "run" / "data").glob("blank.*"))
    (tmp_path / "src" / "a.txt").write_text(text(5, 300))  # fixed: prepared on the next start
    _, [arm] = store.prepare(cfg, tmp_path / "run", VOCAB, BLOCK)
    assert len(arm.train) > 0
    wrong_field = config(SourceConfig("scrape", str(records / "docs.jsonl"), kind="jsonl", field="text"))
    with pytest.raises(DataError, match=r"the source is empty \(299 record\(s\) skipped, first: .*docs.jsonl:1: "
                                        r"no string field 'text'"):
        prepare_run(wrong_field, tmp_path / "run", VOCAB)


def test_a_run_prepared_before_the_manifest_keeps_its_token_files_as_they_are(corpus, tmp_path):
    run = tmp_path / "run"
    codec = TextCodec.train([text(1, 300)], VOCAB)
    (run / "data").mkdir(parents=True)
    codec.tokenizer.save(str(run / "tokenizer.json"))
    old = {s: np.arange(300, dtype=np.uint16) % VOCAB + (s == "val") for s in ("train", "val")}
    for split, tokens in old.items():  # the layout of andrea before data/manifest.json
        tokens.tofile(run / "data" / f"notes.{split}.u16")
    cfg = config(SourceConfig("notes", str(corpus)), SourceConfig("added", str(corpus / "doc3.txt")))
    _, arms = store.prepare(cfg, run, VOCAB, BLOCK)
    assert np.array_equal(arms[0].train, old["train"]) and np.array_equal(arms[0].val, old["val"])
    records = mf.Manifest.load(run / "data").arms
    assert "notes" not in records and records["added"].complete  # an arm added later is prepared
    assert (run / "data" / "notes.train.u16").read_bytes() == old["train"].tobytes()


def test_the_readme_corpus_example_is_a_valid_configuration(tmp_path):
    """The README's corpus example (its "Your own data"; tests/e2e/test_docs.py runs `prepare` with it)."""
    from andrea.config import load as configload
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    example = readme.split("## Your own data", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "corpus.toml").write_text(example)
    cfg = configload.load(preset="andrea-120m", config_file=tmp_path / "corpus.toml")
    assert [s.kind for s in cfg.data.sources] == ["text", "jsonl", "parquet"] and cfg.data.arms == ["pydoc-topics"]


def test_a_source_that_fails_before_its_first_document_leaves_no_recipe_to_hold_it_to(tmp_path):
    """A parquet file whose column is not the configured field fails at its first read. It used to leave the arm's
    record behind (field 'text', no token), so the fixed configuration was refused as a change of field."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    src = tmp_path / "src" / "docs.parquet"
    src.parent.mkdir()
    pq.write_table(pa.table({"body": [text(i, 200) for i in range(20)]}), src)
    run = tmp_path / "run"
    (run / "data").mkdir(parents=True)
    TextCodec.train([text(1, 100)], VOCAB).tokenizer.save(str(run / "tokenizer.json"))
    with pytest.raises(DataError, match=r"no column 'text' \(columns: body\)"):
        prepare_run(config(SourceConfig("web", str(src), kind="parquet")), run, VOCAB)
    assert "web" not in mf.Manifest.load(run / "data").arms and not list((run / "data").glob("web.*"))
    _, manifest, did = prepare_run(config(SourceConfig("web", str(src), kind="parquet", field="body")), run, VOCAB)
    assert did and manifest.arms["web"].complete and manifest.arms["web"].documents == 20


def test_a_new_sources_relative_path_is_recorded_absolute_and_a_prepared_one_keeps_its_own(corpus, tmp_path,
                                                                                           monkeypatch):
    """A relative path was recorded as given: a later start from another working directory found every file
    'gone'. A source not prepared yet is anchored now; one the manifest records keeps its path."""
    from andrea.data.preparation import anchor_paths
    monkeypatch.chdir(corpus.parent)
    fresh = config(SourceConfig("notes", corpus.name))
    anchor_paths(fresh, tmp_path / "run" / "data")
    assert fresh.sources[0].path == str(corpus.absolute())
    prepare_run(config(SourceConfig("notes", corpus.name)), tmp_path / "run", VOCAB)  # recorded as given
    kept = config(SourceConfig("notes", corpus.name), SourceConfig("more", f"{corpus.name}/*.txt"))
    anchor_paths(kept, tmp_path / "run" / "data")
    assert kept.sources[0].path == corpus.name and kept.sources[1].path == str(corpus.absolute() / "*.txt")


def test_a_tokenizer_file_is_anchored_and_a_missing_one_is_one_line(tmp_path, monkeypatch):
    from andrea.config.check import ConfigError
    from andrea.data.preparation import anchor_paths
    monkeypatch.chdir(tmp_path)
    TextCodec.train([text(1, 100)], VOCAB).tokenizer.save(str(tmp_path / "tok.json"))
    cfg = config(SourceConfig("notes", str(tmp_path)), tokenizer="tok.json")
    anchor_paths(cfg, tmp_path / "run" / "data")
    assert cfg.tokenizer == str(tmp_path / "tok.json")
    with pytest.raises(ConfigError, match=r"^data.tokenizer = 'nope.json': no such file \("):
        anchor_paths(config(SourceConfig("notes", str(tmp_path)), tokenizer="nope.json"), tmp_path / "run" / "data")
