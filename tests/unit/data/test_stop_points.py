"""Interrupted then resumed equals uninterrupted, at every commit boundary of a corpus built to hit the edges."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from andrea.config.corpus import DataConfig, SourceConfig
from andrea.data import encode, read
from andrea.data import manifest as mf
from andrea.data.preparation import Interrupted, prepare_run
from tests.unit.data.conftest import text

VOCAB = 512
WORDS = "alpha beta gamma delta epsilon zeta theta iota kappa lambda".split()


def line(i: int) -> str:
    """63 characters and a newline: a 64-byte piece ends exactly after it (the cut after a newline)."""
    words, k = [], i
    while len(" ".join(words)) < 63:
        words.append(WORDS[k % len(WORDS)])
        k += 3
    return (" ".join(words))[:62].rstrip().ljust(62, "x") + "y\n"


def edge_corpus(root: Path) -> list[SourceConfig]:
    """Text files ending exactly at a piece's end (64 B) and a chunk's (256 B), an empty and a binary one, JSON
    lines with records of many pieces (over the streamed-line limit the test sets), and a gzip file."""
    import gzip
    notes = root / "notes"
    notes.mkdir()
    for name, n in (("a", 4), ("b", 1), ("c", 3), ("d", 8), ("e", 5)):  # ends at 256, 512, 1024 B
        (notes / f"{name}.txt").write_text("".join(line(i + n) for i in range(n)))
    assert (notes / "a.txt").stat().st_size == 256 and (notes / "b.txt").stat().st_size == 64
    (notes / "f.txt").write_text("")
    (notes / "g.bin").write_bytes(b"RIFF\x00\x00WAVE" + b"\x80" * 3000)
    with gzip.open(notes / "h.txt.gz", "wt") as f:
        f.write("".join(line(i) for i in range(6)))
    records = [{"body": "".join(line(i) for i in range(n))} for n in (1, 4, 9, 2, 0)]
    records.insert(2, {"other": 1})
    (root / "docs.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return [SourceConfig("notes", str(notes)), SourceConfig("docs", str(root / "docs.jsonl"), kind="jsonl",
                                                                field="body")]


def files_of(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / "data").iterdir())}


def test_a_stop_at_every_commit_then_a_resume_ends_byte_identical(tmp_path, monkeypatch):
    monkeypatch.setattr(read, "SEGMENT_BYTES", 64)
    monkeypatch.setattr(read, "LINE_LIMIT", 100)  # the longer JSON lines are streamed (jsonscan.py)
    monkeypatch.setattr(encode, "CHUNK_BYTES", 256)
    monkeypatch.setattr(encode, "COMMIT_SECONDS", -1.0)  # a commit after every chunk
    cfg = DataConfig(arms=[], sources=edge_corpus(tmp_path))
    straight = tmp_path / "straight"
    straight.mkdir()
    from andrea.data.codec import TextCodec
    TextCodec.train([text(i, 50) for i in range(4)], VOCAB).tokenizer.save(str(straight / "tokenizer.json"))
    prepare_run(cfg, straight, VOCAB)
    want = files_of(straight)
    notes = mf.Manifest.load(straight / "data").arms["notes"]
    assert notes.documents == 6 and notes.counts["binary_files"] == 1 and notes.counts["empty_files"] == 1
    mid_record = 0
    for k in range(1, 500):
        run = tmp_path / f"k{k}"
        run.mkdir()
        shutil.copy(straight / "tokenizer.json", run)
        monkeypatch.setenv("ANDREA_TEST_STOP_AT_COMMIT", str(k))
        try:
            prepare_run(cfg, run, VOCAB)
        except Interrupted:
            pass
        else:
            break  # k is past the last commit: every stop point was tried
        open_arms = {n: a for n, a in mf.Manifest.load(run / "data").arms.items() if not a.complete}
        mid_record += any(a.cursor.get("inner") for a in open_arms.values())
        for name in open_arms:  # what a SIGKILL right after the commit could leave in the arm being written
            for leftover in (run / "data").glob(f"{name}.*.u16"):
                with open(leftover, "ab") as f:
                    f.write(b"\x07\x00" * 5)
        monkeypatch.delenv("ANDREA_TEST_STOP_AT_COMMIT")
        prepare_run(cfg, run, VOCAB)
        assert files_of(run) == want, f"stopped after commit {k}"
        shutil.rmtree(run)
    else:
        pytest.fail("the preparation never ran out of commits")
    assert k > 10 and mid_record >= 3, (k, mid_record)  # stops landed inside streamed records too
