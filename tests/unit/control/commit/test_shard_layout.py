"""The sharded checkpoint's block layout (andrea/control/commit/shard_layout.py), as plain numbers and one buffer:
every block of the padded file has exactly one writer, every byte of every slice reaches the disk through its
rank's blocks or, as a tail under one block, through another's, and the assembled blocks are the file's bytes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from andrea.control.commit.shard_layout import ALIGN, HEADER, ShardImage, file_pieces
from andrea.control.parallel.distributed import shard_bounds
from andrea.rundir import checkpoint as ckpt
from andrea.rundir.checkpoint_write import image_bytes

# Odd sizes: slices far larger than a block, slices under one block (a block spans several ranks), a world
# larger than the parameter count (empty slices), region boundaries on and off block boundaries.
CASES = [(169_728, 2), (50_001, 3), (3_000, 4), (1_000, 7), (5, 8), (1023, 2), (1022, 2), (2046, 3), (1, 1)]


@pytest.mark.parametrize("n,size", CASES)
def test_every_block_of_the_padded_file_has_exactly_one_writer(n, size):
    pieces = file_pieces(n, size)
    total = ckpt.checkpoint_bytes(n)
    assert pieces[0].rank == HEADER and [(p.start, p.end) for p in pieces][0] == (0, 8)
    assert all(a.end == b.start for a, b in zip(pieces, pieces[1:])) and pieces[-1].end == total
    writers = np.zeros(-(-total // ALIGN), dtype=int)
    for p in pieces:
        if p.blocks is not None:
            lo, hi = p.blocks
            assert lo % ALIGN == hi % ALIGN == 0 and lo <= p.start
            writers[lo // ALIGN:hi // ALIGN] += 1
    assert (writers == 1).all(), writers


@pytest.mark.parametrize("n,size", CASES)
def test_a_piece_not_written_by_its_rank_is_a_tail_inside_a_block_another_piece_writes(n, size):
    pieces = file_pieces(n, size)
    for p in pieces:
        covered = (p.start, min(p.blocks[1], p.end) if p.blocks else p.start)  # its bytes its rank writes
        if p.tail is None:
            assert covered == (p.start, p.end)
            continue
        a, b = p.tail
        assert 0 < b - a < ALIGN and b == p.end and covered[1] == a
        owners = [q for q in pieces if q.blocks and q.blocks[0] <= a < q.blocks[1]]
        assert len(owners) == 1 and owners[0] is not p and owners[0].blocks[1] >= b


@pytest.mark.parametrize("n,size", CASES)
def test_the_blocks_every_rank_assembles_are_the_files_bytes(n, size):
    """Stage each rank's slices, exchange tails, fill, and lay every rank's writes into one file image: it is
    the one-process file, padding zeros included."""
    payload = np.random.default_rng(n).standard_normal(3 * n, dtype=np.float32)
    expected = np.zeros(image_bytes(n), dtype=np.uint8)
    expected[:8] = np.frombuffer(ckpt.header(9, n), dtype=np.uint8)
    expected[8:8 + 12 * n] = payload.view(np.uint8)
    images = []
    for r in range(size):
        image = ShardImage(n, size, r, pinned=False)
        lo, hi = shard_bounds(n, size, r)
        for region, view in enumerate(image.views):
            if hi > lo:
                view.copy_(torch.from_numpy(payload[region * n + lo:region * n + hi]))
        images.append(image)
    messages = [image.tails().clone() for image in images]
    got = np.full(image_bytes(n), 0xAB, dtype=np.uint8)  # every byte must be written over
    for image in images:
        image.fill(messages, ckpt.header(9, n))
        for off, view in image.writes():
            assert off % ALIGN == len(view) % ALIGN == np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN == 0
            got[off:off + len(view)] = np.frombuffer(view, dtype=np.uint8)
    assert np.array_equal(got, expected)
    assert sum(image.writes_last_block for image in images) == 1
