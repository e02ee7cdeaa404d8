"""Single-bit corruption for the seal tests (tests/unit/rundir/): every flip of a file's bytes that a value check
could not see, since the result still parses as JSON. Reads and writes nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator


def json_flips(data: bytes) -> Iterator[tuple[int, int, bytes, object]]:
    """(byte index, bit, the flipped bytes, their JSON value) for every single-bit flip of `data` that is still
    UTF-8 JSON (the others a reader refuses as no JSON)."""
    for i in range(len(data)):
        for bit in range(8):
            flipped = bytearray(data)
            flipped[i] ^= 1 << bit
            try:
                yield i, bit, bytes(flipped), json.loads(flipped.decode())
            except ValueError:
                continue
