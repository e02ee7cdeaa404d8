"""An arm's token files, written as the stream is encoded: the train/val split by spans, and durable commits.

Writes `data/<arm>.train.<u16|u32>` and `data/<arm>.val.<u16|u32>`: flat little-endian token ids. The arm's token
stream (each document's tokens, then <|endoftext|>, documents in source order) is cut into spans of `span` tokens;
of each span the first `span - floor(span · val_fraction)` tokens are training tokens and the rest held out. So
the held-out set is spread over the whole corpus (not its last files), the split of a token depends only on its
position in the stream (never on how the stream was chunked, interrupted or resumed), and memory is one chunk.
`span_for` picks the span from the expected size of the arm: ~64 spans for a small arm, 2^20 tokens for a large
one; the manifest records it.

A commit flushes and fsyncs both files and returns their lengths, which the manifest then records; a later start
truncates each file back to its recorded length, so bytes written after the last commit (a SIGKILL, a power cut)
are never read.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

MAX_SPAN = 1 << 20
MIN_SPAN = 1 << 10


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def suffix(dtype: np.dtype) -> str:
    return "u16" if np.dtype(dtype).itemsize == 2 else "u32"


def span_for(expected_bytes: int) -> int:
    """~64 spans for the arm's expected tokens (a token is ~3 bytes of text or more), within [2^10, 2^20]."""
    return int(min(MAX_SPAN, max(MIN_SPAN, expected_bytes // 3 // 64)))


def train_part(span: int, val_fraction: float) -> int:
    return span - int(span * val_fraction)


class SplitWriter:
    """Appends an arm's token stream to its train and val files; `commit()` makes everything so far durable."""

    def __init__(self, train_path: Path, val_path: Path, dtype: np.dtype, span: int, val_fraction: float,
                 train_len: int = 0, val_len: int = 0):
        self.paths, self.dtype = (train_path, val_path), np.dtype(dtype)
        self.span, self.train_cut = span, train_part(span, val_fraction)
        self.lengths = [train_len, val_len]
        self.files = [self._open(p, n) for p, n in zip(self.paths, self.lengths)]

    def _open(self, path: Path, length: int):
        f = open(path, "r+b" if path.exists() else "w+b")
        f.truncate(length * self.dtype.itemsize)  # drop whatever was written after the last commit
        f.seek(0, os.SEEK_END)
        return f

    @property
    def stream(self) -> int:
        return self.lengths[0] + self.lengths[1]

    def append(self, tokens: np.ndarray) -> None:
        tokens = np.asarray(tokens, dtype=self.dtype)
        i = 0
        while i < len(tokens):
            q = self.stream % self.span  # position in the current span
            split = 0 if q < self.train_cut else 1
            room = (self.train_cut if split == 0 else self.span) - q
            part = tokens[i:i + room]
            self.files[split].write(part.tobytes())
            self.lengths[split] += len(part)
            i += len(part)

    def commit(self) -> tuple[int, int]:
        for f in self.files:
            f.flush()
            os.fsync(f.fileno())
        return self.lengths[0], self.lengths[1]

    def close(self) -> None:
        for f in self.files:
            f.close()


def split_reference(stream: np.ndarray, span: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The split of a whole stream at once (what `SplitWriter` must produce however it is fed); for tests."""
    cut = train_part(span, val_fraction)
    pos = np.arange(len(stream)) % span
    return stream[pos < cut], stream[pos >= cut]
