"""The edges of `andrea prepare` (issue #36): each case handled exactly, or refused in one line saying what to do."""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import lzma
import multiprocessing
import random
import signal
import threading
import time
import zipfile

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
import pytest

from andrea.config.corpus import DataConfig, SourceConfig
from andrea.data import encode, read, store, tokentrain
from andrea.data import manifest as mf
from andrea.data.codec import EOT, TextCodec
from andrea.data.preparation import Interrupted, prepare_run
from andrea.data.sources import DataError, source_files
from tests.unit.data.conftest import text

VOCAB, BLOCK = 512, 16


def config(*sources: SourceConfig, **data) -> DataConfig:
    return DataConfig(arms=[], sources=list(sources), **data)


@pytest.fixture
def cli_logging():
    """cli.main configures the root logger once, onto this test's captured stderr: undone after the test."""
    handlers = list(logging.root.handlers)
    yield
    logging.root.handlers[:] = handlers


def pieces_of(path, kind="text", key="text"):
    counts = read.Counts()
    return list(read.pieces(path, kind, key, 0, counts)), counts


# --- inputs that hung ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", ["", "/**/*.txt", "/**"])
def test_symlink_loops_are_walked_once_and_each_file_listed_once(tmp_path, pattern):
    root = tmp_path / "src"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "one.txt").write_text("one")
    (root / "a" / "b" / "two.txt").write_text("two")
    (root / "a" / "b" / "up").symlink_to("..")  # a loop
    (root / "a" / "b" / "again").symlink_to(root / "a")  # another way into the loop
    (root / "alias.txt").symlink_to(root / "a" / "one.txt")  # one file under two names
    found = []
    walker = threading.Thread(target=lambda: found.append(source_files(SourceConfig("s", f"{root}{pattern}"))),
                              daemon=True)
    walker.start()
    walker.join(20)
    assert found, "listing the source never finished"
    assert sorted(p.resolve() for p in found[0]) == sorted({(root / "a" / "one.txt").resolve(),
                                                           (root / "a" / "b" / "two.txt").resolve()})


def test_a_binary_file_among_text_is_skipped_and_counted_and_never_cut_byte_by_byte(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "notes.txt").write_text(text(1, 300))
    (src / "silence.wav").write_bytes(b"RIFF" + b"\x80" * 220_000)  # 8-bit silence: no NUL, all 0x80
    (src / "shot.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00" + bytes(range(256)) * 40)
    pieces, counts = pieces_of(src / "silence.wav")
    assert pieces == [] and counts.binary_files == 1 and counts.first_binary == str(src / "silence.wav")
    cut = list(read._record([b"\x80" * 220_000], 0, 1, 0, read.Counts()))
    assert len(cut) <= 4  # 64 KiB pieces (it was one byte each: ~30 minutes)
    prepare_run(config(SourceConfig("notes", str(src))), tmp_path / "run", VOCAB)
    rec = mf.Manifest.load(tmp_path / "run" / "data").arms["notes"]
    assert rec.documents == 1 and rec.counts["binary_files"] == 2


# --- damaged or unsupported compressed input -------------------------------------------------------------------
def test_bz2_and_xz_are_read_as_text_and_damaged_or_archived_input_is_one_line_naming_the_file(tmp_path):
    import zstandard
    body = text(3, 800)
    (tmp_path / "a.txt.bz2").write_bytes(bz2.compress(body.encode()))
    (tmp_path / "b.txt.xz").write_bytes(lzma.compress(body.encode()))
    (tmp_path / "c.txt.gz").write_bytes(gzip.compress(body.encode()) * 2)  # two members
    for name, twice in (("a.txt.bz2", 1), ("b.txt.xz", 1), ("c.txt.gz", 2)):
        pieces, _ = pieces_of(tmp_path / name)
        assert "".join(p.text for p in pieces) == body * twice, name
    cut = tmp_path / "cut.txt.zst"
    cut.write_bytes(zstandard.ZstdCompressor().compress(body.encode())[:-12])
    plain_gz = tmp_path / "plain.gz"
    plain_gz.write_text(body)
    zipped = tmp_path / "docs.txt"
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("inner.txt", body)
    for path, why in ((cut, "truncated zstd file"), (tmp_path / "a.txt.bz2", None), (plain_gz, "not a valid gzip"),
                      (zipped, "a zip archive, which andrea does not read .* unpack it")):
        if why is None:
            path.write_bytes(path.read_bytes()[:-30])
            why = "truncated bzip2 file"
        with pytest.raises(DataError, match=f"^{path}: {why}"):
            pieces_of(path)


def test_a_uint32_token_file_declared_uint16_is_refused_with_the_fix(tmp_path):
    ids = np.arange(100, 400, dtype=np.uint32)
    ids.tofile(tmp_path / "ids.bin")
    cfg = config(SourceConfig("ids", str(tmp_path / "ids.bin"), kind="tokens", dtype="uint16"))
    with pytest.raises(DataError, match=r"looks like a uint32 token file; set data.sources\['ids'\].dtype = 'uint32'"):
        prepare_run(cfg, tmp_path / "run", VOCAB)


def test_a_token_file_grown_after_preparation_is_read_to_its_recorded_length_with_one_warning(tmp_path, caplog):
    path = tmp_path / "ids.bin"
    (np.arange(2000, dtype=np.uint16) % VOCAB).tofile(path)
    cfg = config(SourceConfig("ids", str(path), kind="tokens"))
    _, [before] = store.prepare(cfg, tmp_path / "run", VOCAB, BLOCK)
    with open(path, "ab") as f:
        f.write(np.full(500, 60_000, dtype=np.uint16).tobytes())  # ids the model has no row for
    with caplog.at_level(logging.WARNING, logger="andrea.data"):
        _, [after] = store.prepare(cfg, tmp_path / "run", VOCAB, BLOCK)
    assert len(after.train) + len(after.val) == 2000 and int(after.val.max()) < VOCAB
    assert np.array_equal(after.train, before.train) and np.array_equal(after.val, before.val)
    [line] = [r.getMessage() for r in caplog.records if "ids" in r.getMessage()]
    assert "changed since it was checked; training reads the 2000 tokens recorded then" in line


# --- memory ----------------------------------------------------------------------------------------------------
def test_a_huge_json_record_is_read_in_pieces_in_bounded_memory_and_equals_the_parsed_record(tmp_path, monkeypatch):
    import tracemalloc
    monkeypatch.setattr(read, "LINE_LIMIT", 1 << 16)
    rng = random.Random(5)
    body = "".join(rng.choice(["word ", "näive ", "\"quoted\" ", "tab\t", "line\n", "日本語 ", "😀 ", "\\ "])
                   for _ in range(1_200_000))
    line = json.dumps({"id": 1, "meta": {"body": "not this"}, "body": body, "tail": [1, 2.5, None]})
    path = tmp_path / "big.jsonl"
    path.write_text(json.dumps({"body": "small"}) + "\n" + line + "\n" + '{"body": "cut off' + "\n")
    counts, same, ends, at, want = read.Counts(), True, 0, 0, "small" + body
    tracemalloc.start()
    for piece in read.pieces(path, "jsonl", "body", 0, counts):  # compared as they come: none is kept
        same = same and piece.text == want[at:at + len(piece.text)]
        at, ends = at + len(piece.text), ends + piece.doc_end
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(line) > 10_000_000 and peak < 10_000_000, peak  # a few 1 MiB blocks, whatever the record's size
    assert same and at == len(want) and ends == 2
    assert counts.skipped_records == 1 and counts.first_skipped.startswith(f"{path}:3: not JSON")


def test_a_parquet_row_group_is_read_in_slices(tmp_path, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [text(i, 30) for i in range(400)]
    path = tmp_path / "one_group.parquet"
    pq.write_table(pa.table({"text": rows}), path, row_group_size=1000)
    assert pq.ParquetFile(path).metadata.num_row_groups == 1
    sizes = []
    real = pq.ParquetFile.iter_batches

    def spy(self, *a, **k):
        for batch in real(self, *a, **k):
            sizes.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    monkeypatch.setattr(read, "BATCH_BYTES", 20_000)
    pieces, _ = pieces_of(path, "parquet", "text")
    assert [p.text for p in pieces] == rows and len(sizes) > 10 and max(sizes) < 100
    rest, _ = list(read.pieces(path, "parquet", "text", pieces[250].end, read.Counts())), None
    assert [p.text for p in rest] == rows[251:]


# --- the tokenizer ---------------------------------------------------------------------------------------------
def test_the_tokenizer_trains_on_the_sample_size_asked_across_thousands_of_small_files(tmp_path, caplog):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(1500):
        (src / f"f{i:04d}.txt").write_text(text(i, 12))  # ~500 B each
    total = sum(p.stat().st_size for p in src.iterdir())
    cfg = config(SourceConfig("notes", str(src)), tokenizer_sample_bytes=total // 2)
    with caplog.at_level(logging.INFO, logger="andrea.data"):
        prepare_run(cfg, tmp_path / "run", VOCAB)
    sample = mf.Manifest.load(tmp_path / "run" / "data").tokenizer["sample_bytes"]
    assert 0.95 * total // 2 <= sample <= total // 2  # was the heads of 5 files: 2.5 KB
    lines = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("data: training the tokenizer (vocab 512) on a sample of up to") for m in lines)


def test_a_stop_while_the_tokenizer_trains_in_its_process_ends_it_at_once(tmp_path, monkeypatch):
    monkeypatch.setattr(tokentrain, "IN_PROCESS_BYTES", 0)  # even this small sample trains in a child process
    (tmp_path / "a.txt").write_text(text(2, 3000))
    arm = encode.TextArm("a", "text", "text", 0, SourceConfig("a", str(tmp_path / "a.txt")))
    plans = {"a": mf.write_plan(tmp_path / "plan.json", [tmp_path / "a.txt"])}
    polls = iter(range(3))
    t0 = time.monotonic()
    with pytest.raises(Interrupted, match="stopped while training the tokenizer"):
        tokentrain.train_tokenizer([arm], plans, 1 << 20, VOCAB, lambda: next(polls, None) is None)
    assert time.monotonic() - t0 < 2.0 and not multiprocessing.active_children()
    codec, sample, _ = tokentrain.train_tokenizer([arm], plans, 1 << 20, VOCAB, lambda: False)
    assert sample == len(text(2, 3000).encode()) and codec.eot is not None


def test_a_tokenizer_that_adds_a_prefix_space_is_refused_in_one_line(tmp_path):
    from tokenizers import pre_tokenizers
    codec = TextCodec.train([text(1, 100)], VOCAB)
    codec.tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    path = tmp_path / "tokenizer.json"
    codec.tokenizer.save(str(path))
    (tmp_path / "a.txt").write_text(text(1, 100))
    cfg = config(SourceConfig("a", str(tmp_path / "a.txt")), tokenizer=str(path))
    with pytest.raises(DataError, match=f"^{path}: cannot prepare data with this tokenizer: .*prefix space.*"
                                        "add_prefix_space=false"):
        prepare_run(cfg, tmp_path / "run", VOCAB)


# --- smaller edges ---------------------------------------------------------------------------------------------
def test_a_literal_endoftext_inside_a_document_is_text_and_counted(tmp_path, caplog):
    (tmp_path / "a.txt").write_text(f"before {EOT} after\n" + text(1, 200))
    (tmp_path / "b.txt").write_text(text(2, 200))
    cfg = config(SourceConfig("a", str(tmp_path)))
    with caplog.at_level(logging.WARNING, logger="andrea.data"):
        codec, [arm] = store.prepare(cfg, tmp_path / "run", VOCAB, BLOCK)
    stream = np.concatenate([arm.train, arm.val])
    assert int((stream == codec.eot).sum()) == 2  # one boundary per document, none inside
    assert mf.Manifest.load(tmp_path / "run" / "data").arms["a"].counts["literal_eot"] == 1
    assert any("1 literal <|endoftext|> string(s) inside documents, encoded as text" in r.getMessage()
               for r in caplog.records)


def test_a_nested_field_name_says_no_record_had_it(tmp_path):
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"meta": {"body": text(i, 5)}}) for i in range(20)))
    cfg = config(SourceConfig("d", str(tmp_path / "d.jsonl"), kind="jsonl", field="meta.body"))
    with pytest.raises(DataError, match=r"the source is empty \(no text to train the tokenizer on: 20 record\(s\) "
                                        r"skipped, first: .*d.jsonl:1: no string field 'meta.body'; field 'meta.body' "
                                        r"names a top-level key or column: nested fields are not read\)"):
        prepare_run(cfg, tmp_path / "run", VOCAB)


def test_changing_a_prepared_arms_field_is_refused_before_run_toml_changes(tmp_path, capsys, cli_logging):
    from andrea import cli
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps({"body": text(i, 5), "alt": "x"}) for i in range(50)))
    run = tmp_path / "run"

    def prepare(field):
        return cli.main(["prepare", "--preset", "andrea-tiny", "--run-dir", str(run), "--set", "data.arms=[]",
                         "--set", f"data.sources=[{{name='d', path='{tmp_path / 'd.jsonl'}', kind='jsonl', "
                                  f"field='{field}'}}]"])

    assert prepare("body") == 0
    before = (run / "run.toml").read_bytes()
    assert prepare("alt") == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("andrea: error: data.sources['d'].field = 'alt', but the arm was prepared with field = "
                          "'body'") and "give the source another name" in err
    assert (run / "run.toml").read_bytes() == before


def test_a_resumed_preparation_reports_progress_from_where_it_stopped(tmp_path, monkeypatch, caplog):
    from andrea.control.observe.progress import ByteProgress
    monkeypatch.setattr(encode, "CHUNK_BYTES", 8192)
    monkeypatch.setattr(encode, "COMMIT_SECONDS", -1.0)
    monkeypatch.setattr(ByteProgress, "LOG_SECONDS", 0.0)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"{i}.txt").write_text(text(i, 200))
    cfg = config(SourceConfig("notes", str(src)))
    monkeypatch.setenv("ANDREA_TEST_STOP_AT_COMMIT", "3")
    with pytest.raises(Interrupted):
        prepare_run(cfg, tmp_path / "run", VOCAB)
    monkeypatch.delenv("ANDREA_TEST_STOP_AT_COMMIT")
    with caplog.at_level(logging.INFO, logger="andrea.control.observe.progress"):
        prepare_run(cfg, tmp_path / "run", VOCAB)
    first = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("prepare: "))
    assert int(first.split("(")[1].split()[0]) > 0, first  # "prepare: 0.0 of 0.1 MB (0 %)" before


def test_cjk_text_cut_into_pieces_tokenizes_exactly_as_the_whole(monkeypatch):
    rng = random.Random(7)
    han = [chr(c) for c in range(0x4E00, 0x4E00 + 400)]
    doc = "".join("".join(rng.choice(han) for _ in range(rng.randint(3, 40))) + rng.choice("，。、；：！？「」")
                  for _ in range(3000))
    codec = TextCodec.train([doc], 1000)
    monkeypatch.setattr(read, "SEGMENT_BYTES", 1024)
    pieces = list(read._record([doc.encode()], 0, 1, 0, read.Counts()))
    assert len(pieces) > 50 and "".join(p.text for p in pieces) == doc
    assert [i for p in pieces for i in codec.encode(p.text)] == codec.encode(doc)


def test_a_sigterm_before_prepare_takes_over_is_a_clean_stop(tmp_path, capsys, cli_logging):
    from andrea import cli
    from andrea.control.run import early_signals
    (tmp_path / "a.txt").write_text(text(1, 200))
    previous = {s: signal.getsignal(s) for s in early_signals.AT_START}
    try:
        early_signals.install()  # as andrea/__main__.py does before its imports
        signal.raise_signal(signal.SIGTERM)  # "in the first second"
        code = cli.main(["prepare", "--preset", "andrea-tiny", "--run-dir", str(tmp_path / "run"), "--set",
                         "data.arms=[]", "--set", f"data.sources=[{{name='a', path='{tmp_path / 'a.txt'}'}}]"])
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    out = capsys.readouterr()
    assert code == 0 and "SIGTERM received: stopping data preparation" in out.err
    assert "preparation stopped" in out.out and "again" in out.out
    assert early_signals.take() is None  # taken once: a later prepare in this process is not stopped by it


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3), max_leaves=8)
field_values = st.text(alphabet=st.sampled_from(list('a é日😀"\\\n\t\x01') + ["\ud83d", "\ude00"])) | json_values


@settings(max_examples=150, deadline=None)
@given(obj=st.dictionaries(st.sampled_from(["body", "x", "bod"]), field_values, max_size=4),
       ascii=st.booleans(), cut=st.integers(0, 60), block=st.sampled_from([1, 2, 3, 7, 1000]))
def test_a_streamed_json_line_reads_exactly_as_json_loads(obj, ascii, cut, block):
    from andrea.data import jsonscan
    line = json.dumps(obj, ensure_ascii=ascii).encode("utf-8", "surrogatepass")
    line = line[:len(line) - cut] if cut % 3 == 0 else line  # some lines truncated
    try:
        record = json.loads(line)
        value = record.get("body") if isinstance(record, dict) else None
        want = value.encode("utf-8", "surrogatepass") if isinstance(value, str) else None
    except ValueError:
        want = "not JSON"
    scanner = jsonscan.Scanner("body")
    try:
        for i in range(0, len(line), block):
            scanner.feed(line[i:i + block])
        scanner.finish()
    except jsonscan.NotJSON:
        assert want == "not JSON"
        return
    if scanner.span is None:
        assert want is None
        return
    a = scanner.span[0]
    got = b"".join(jsonscan.unescape(line[a + i:a + i + block] for i in range(0, len(line) - a, block)))
    assert got == want
