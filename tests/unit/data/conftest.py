"""Corpora made on the spot for the data pipeline's tests: text, compressed text, JSON lines and parquet."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest

WORDS = ("checkpoint", "gradient", "the", "run", "survives", "power", "loss", "resume", "é", "naïve", "日本語",
         "data", "token", "42", "x=1;", "(a, b)", "\tindent", "    def f():", "#", "ok.")


def text(seed: int, lines: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        out.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 12))))
    return "\n".join(out) + ("\n\n" if seed % 2 else "")


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """A directory of text files (one far over the 64 KiB piece size), gzip and zstd among them, a hidden file."""
    import zstandard
    root = tmp_path_factory.mktemp("corpus")
    (root / "sub").mkdir()
    for i in range(6):
        (root / f"doc{i}.txt").write_text(text(i, 40 + 30 * i))
    (root / "sub" / "big.md").write_text(text(99, 24_000))  # ~1 MB: cut into pieces
    with gzip.open(root / "sub" / "packed.txt.gz", "wt") as f:
        f.write(text(7, 500))
    (root / "sub" / "packed2.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(text(8, 400).encode()))
    (root / ".hidden").write_text("never a document")
    return root


@pytest.fixture(scope="session")
def records(tmp_path_factory) -> Path:
    """A JSON-lines file of documents under "body", with the bad lines a scrape has."""
    root = tmp_path_factory.mktemp("jsonl")
    lines = [json.dumps({"body": text(i, 5 + i % 7), "id": i}) for i in range(300)]
    lines[10] = "{not json"
    lines[20] = json.dumps({"id": 20})
    lines[30] = ""
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    with gzip.open(root / "more.jsonl.gz", "wt") as f:
        f.write("\n".join(json.dumps({"body": text(i, 3)}) for i in range(50)))  # no final newline
    return root
