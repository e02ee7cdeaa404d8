"""andrea/control/run/allocator.py: a CPU trainer's process serves large blocks from the heap and keeps them once freed.

Observed through glibc's own accounting (mallinfo2: bytes in mmapped blocks, free bytes kept in the heap) in a fresh
interpreter, so no other test's allocations and no setting of this process take part."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.runs import ROOT

PROBE = r"""
import ctypes, json, torch
from andrea.config.load import from_dict
from andrea.control.run.trainer import Trainer

class MallInfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
BIG = 96 << 20

def big_block():  # (bytes in mmapped blocks while it lives, free heap bytes kept after it is freed)
    t = torch.ones(BIG, dtype=torch.uint8)
    mapped = libc.mallinfo2().hblkhd
    del t
    return mapped, libc.mallinfo2().fordblks

before = big_block()
Trainer(from_dict({"model": {"n_layer": 1, "n_head": 1, "n_embd": 8, "block_size": 8, "vocab_size": 300}}),
        torch.device("cpu"))
after = big_block()
print(json.dumps({"before": before, "after": after, "big": BIG}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and mallinfo2")
def test_a_cpu_trainer_serves_large_blocks_from_the_heap_and_keeps_them_freed():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.splitlines()[-1])
    big = got["big"]
    (mapped_before, kept_before), (mapped_after, kept_after) = got["before"], got["after"]
    assert mapped_before >= big and kept_before < big  # glibc's default: an mmap, unmapped when freed
    assert mapped_after < big and kept_after >= big    # the trainer's: from the heap, and kept for the next step
