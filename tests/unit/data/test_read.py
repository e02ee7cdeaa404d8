"""read.py: pieces that tokenize like the whole document, readers that resume exactly, and counts of what is not text."""

from __future__ import annotations

import gzip
import json

import pytest
from hypothesis import given, settings, strategies as st

from andrea.data import read
from andrea.data.codec import TextCodec
from andrea.data.sources import DataError
from tests.unit.data.conftest import WORDS, text


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec.train([text(i, 200) for i in range(20)], 400)


def all_pieces(path, kind="text", key="text", start=0, line=1):
    counts = read.Counts()
    return list(read.pieces(path, kind, key, start, counts, line)), counts


# One-character separators between words: every 32-byte window holds a place where pre-tokenization splits anyway.
documents = st.lists(st.tuples(st.sampled_from([w.strip() for w in WORDS if w.strip()]), st.sampled_from(" \n")),
                     min_size=1, max_size=300).map(lambda ws: "".join(w + sep for w, sep in ws))


@settings(max_examples=60, deadline=None)
@given(doc=documents)
def test_the_pieces_of_a_long_document_tokenize_exactly_as_the_whole_document(codec, doc):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(read, "SEGMENT_BYTES", 64)
        pieces = list(read._record([doc.encode()], 0, 1, 0, read.Counts()))
    assert "".join(p.text for p in pieces) == doc
    assert all(len(p.text.encode()) <= 64 for p in pieces) and [p.doc_end for p in pieces][-1]
    whole = codec.tokenizer.encode(doc, add_special_tokens=False).ids
    assert [i for p in pieces for i in codec.tokenizer.encode(p.text, add_special_tokens=False).ids] == whole


@settings(max_examples=40, deadline=None)
@given(data=st.binary(min_size=1, max_size=600))
def test_text_without_a_clean_cut_loses_no_byte_and_never_splits_a_character(data):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(read, "SEGMENT_BYTES", 16)
        counts = read.Counts()
        pieces = list(read._record([data.decode("utf-8", "replace").encode()], 0, 1, 0, counts))
    assert counts.undecodable_bytes == 0  # cuts fall on character boundaries only
    assert "".join(p.text for p in pieces) == data.decode("utf-8", "replace")


@pytest.mark.parametrize("name", ["sub/big.md", "sub/packed.txt.gz", "sub/packed2.txt.zst"])
def test_a_text_reader_restarted_at_any_resumable_piece_yields_the_rest_unchanged(corpus, monkeypatch, name):
    monkeypatch.setattr(read, "SEGMENT_BYTES", 4096)
    path = corpus / name
    full, _ = all_pieces(path)
    assert len(full) > 3 and full[-1].doc_end and not any(p.doc_end for p in full[:-1])
    assert "".join(p.text for p in full) == (gzip.decompress(path.read_bytes()).decode() if name.endswith(".gz")
                                             else __import__("zstandard").ZstdDecompressor().decompressobj()
                                             .decompress(path.read_bytes()).decode() if name.endswith(".zst")
                                             else path.read_text())
    for k in (0, len(full) // 2, len(full) - 2):
        rest, _ = all_pieces(path, start=full[k].end)
        assert [(p.text, p.end) for p in rest] == [(p.text, p.end) for p in full[k + 1:]]


def test_json_lines_skip_and_name_bad_records_and_resume_with_their_line_numbers(records):
    path = records / "docs.jsonl"
    full, counts = all_pieces(path, "jsonl", "body")
    docs = [p for p in full if p.doc_end]
    assert len(docs) == 297  # 300 lines: one not JSON, one without the field, one blank
    assert counts.skipped_records == 2
    assert counts.first_skipped.startswith(f"{path}:11: not JSON")
    expected = [json.loads(line)["body"] for line in path.read_text().splitlines()
                if line.startswith("{\"body\"")]
    assert [p.text for p in docs] == expected
    resume = docs[14]  # past the first bad line, before the second
    rest, counts = all_pieces(path, "jsonl", "body", start=resume.end, line=resume.line)
    assert [p.text for p in rest] == [p.text for p in full[full.index(resume) + 1:]]
    assert counts.first_skipped.startswith(f"{path}:21: no string field 'body'")
    gz, _ = all_pieces(records / "more.jsonl.gz", "jsonl", "body")
    assert len(gz) == 50  # the last line has no newline and is still a document


def test_undecodable_bytes_are_replaced_and_counted_and_empty_files_counted(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xc3\xa9 \xff\xfe ok")
    pieces, counts = all_pieces(bad)
    assert [p.text for p in pieces] == ["café \ufffd\ufffd ok"] and counts.undecodable_bytes == 2
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    pieces, counts = all_pieces(empty)
    assert pieces == [] and counts.empty_files == 1 and counts.first_empty == str(empty)


def test_a_truncated_gzip_file_is_one_error_naming_it(tmp_path):
    path = tmp_path / "cut.txt.gz"
    path.write_bytes(gzip.compress(text(3, 400).encode())[:-20])
    with pytest.raises(DataError, match=f"^{path}: truncated gzip file"):
        all_pieces(path)


def test_parquet_rows_by_row_group_resume_at_a_row_and_a_missing_column_is_named(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "docs.parquet"
    rows = [text(i, 4) for i in range(100)]
    rows[7] = None
    pq.write_table(pa.table({"content": rows, "n": list(range(100))}), path, row_group_size=30)
    full, counts = all_pieces(path, "parquet", "content")
    assert [p.text for p in full] == [r for r in rows if r] and counts.skipped_records == 1
    assert counts.first_skipped.startswith(f"{path}:row 7:")
    rest, _ = all_pieces(path, "parquet", "content", start=full[40].end)
    assert [p.text for p in rest] == [p.text for p in full[41:]]
    with pytest.raises(DataError, match=f"^{path}: no column 'text' \\(columns: content, n\\)"):
        all_pieces(path, "parquet", "text")
