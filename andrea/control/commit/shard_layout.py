"""Which rank writes which block of a sharded checkpoint, and the staging buffer that lets it (ShardImage).

Pure layout over plain numbers, plus one host buffer; no I/O. The file (format: andrea/rundir/checkpoint.py) is, in
file order, the header [0, 8) and then, for each region w, m, v, every rank's slice [lo, hi) of it (ZeRO-1,
andrea/control/parallel/distributed.shard_bounds, with the run's `cuts` when the optimizer placed them): these *pieces* tile [0, S), S = 8 + 12·n. The writes go out with O_DIRECT,
which moves whole ALIGN-byte blocks only, and a block where two pieces meet cannot be written whole by either
owner of a piece. Partial blocks written through the page cache cost more than their size: each takes the
inode exclusively, so it waits for the other ranks' O_DIRECT writes in flight (measured on ext4: 7-10 ms on a
45 ms commit of ANDREA-12M), and over an allocated file (the spare, andrea/rundir/spare.py) it first reads the block.

So every block has one writer, the owner of its last byte in the file (the last block is padded to ALIGN with
zeros, then the file is cut to S). A piece that ends inside a block it does not own sends that *tail*, under
ALIGN bytes, to the block's owner; the header is such a tail, and every rank knows it. With those tails (one
small all-gather, andrea/control/commit/shards.py), each rank holds every byte of the blocks it owns, and writes
only whole, aligned blocks: no page cache, no lock taken exclusively over an allocated file, no read.

A rank's staging buffer (ShardImage) holds, per piece, the blocks from the one holding the piece's first byte
to the one holding its last: the piece itself at its offset within its first block (what the snapshot fills),
the tails of earlier pieces in front of it (filled at the commit), zeros behind it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from andrea.control.commit.writer import aligned_host_buffer
from andrea.control.parallel.distributed import shard_bounds
from andrea.rundir import checkpoint as ckpt, checkpoint_write

ALIGN = checkpoint_write.DIRECT_ALIGN
HEADER = -1  # the rank of the header piece: every rank has it


def down(x: int) -> int:
    return x // ALIGN * ALIGN


def up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


@dataclass(frozen=True)
class Piece:
    """File bytes [start, end) that one rank holds: its slice of one region (or the header, rank HEADER)."""

    rank: int
    region: int  # 0 w, 1 m, 2 v; the header: -1
    start: int
    end: int
    size: int  # S, the checkpoint's bytes

    @property
    def owns_last_block(self) -> bool:
        """Whether the block holding this piece's last byte is this piece's to write: its last byte is the
        block's own last byte in the file (the piece ends on a block boundary, or at the end of the file)."""
        return self.rank != HEADER and (self.end % ALIGN == 0 or self.end == self.size)

    @property
    def tail(self) -> tuple[int, int] | None:
        """[a, b): this piece's bytes in the one block it does not own (sent to that block's owner), or None."""
        return None if self.owns_last_block else (max(self.start, down(self.end - 1)), self.end)

    @property
    def blocks(self) -> tuple[int, int] | None:
        """[a, b), block-aligned: the file bytes this piece's rank writes for it, or None when it owns no block.
        The last block of the file runs past S to the next boundary (zeros; the file is cut to S after)."""
        lo = down(self.start)
        hi = up(self.end) if self.owns_last_block else down(self.end - 1)
        return (lo, hi) if self.rank != HEADER and hi > lo else None


def file_pieces(n: int, size: int, cuts: tuple[int, ...] | None = None) -> list[Piece]:
    """Every piece of the file, in file order: the header, then w, m, v, each by rank (empty slices left out);
    `cuts`: the run's shard boundaries (World.cuts), None for the equal split."""
    total = ckpt.checkpoint_bytes(n)
    pieces = [Piece(HEADER, -1, 0, ckpt.HEADER.size, total)]
    for region in range(3):
        for rank in range(size):
            lo, hi = shard_bounds(n, size, rank, cuts)
            if hi > lo:
                base = ckpt.HEADER.size + 4 * region * n
                pieces.append(Piece(rank, region, base + 4 * lo, base + 4 * hi, total))
    return pieces


class ShardImage:
    """One staging buffer of `rank` of `size`: its three slices, each within the whole blocks it writes.

    `views` = (w[lo:hi], m[lo:hi], v[lo:hi]) as float32 tensors: what ZeroTrainer.snapshot fills. At the commit,
    `tails()` is what this rank sends, `fill(tails_of_every_rank, header)` puts the others' tails in front of
    its pieces, and `writes()` is the (file offset, bytes) of every block it owns: offset, length and host
    address all ALIGN-aligned, so every byte goes to the disk with O_DIRECT straight from here.
    """

    def __init__(self, n: int, size: int, rank: int, pinned: bool, cuts: tuple[int, ...] | None = None):
        self.n, self.size, self.rank = n, size, rank
        self.pieces = file_pieces(n, size, cuts)
        self.mine = [p for p in self.pieces if p.rank == rank]
        self.lo, self.hi = shard_bounds(n, size, rank, cuts)
        self.base, pos = [], 0  # each piece's buffer position of its first block
        for p in self.mine:
            self.base.append(pos)
            pos += up(p.end) - down(p.start)
        # The single writer's kind of buffer (2 MiB pages on CPU): O_DIRECT from 4 KiB pages costs ~2x the time.
        self.image = aligned_host_buffer(max(pos, ALIGN), pinned)  # zeroed: the file's padding past S
        k = self.hi - self.lo
        views = [self.image[b + p.start - down(p.start):][:4 * k].view(torch.float32)
                 for b, p in zip(self.base, self.mine)]
        empty = torch.empty(0, dtype=torch.float32)
        self.views = tuple(views) if views else (empty, empty, empty)
        # This rank's tails, in a fixed-size message: one ALIGN slot per region (a tail is under ALIGN bytes).
        self.message = torch.zeros(3 * ALIGN, dtype=torch.uint8)

    def _at(self, p: Piece, offset: int) -> int:
        """The buffer position of file byte `offset` of this rank's piece `p`."""
        return self.base[self.mine.index(p)] + offset - down(p.start)

    def tails(self) -> torch.Tensor:
        """(3·ALIGN,) uint8: slot r holds the tail of this rank's piece of region r (zeros where none)."""
        for p in self.mine:
            if p.tail is not None:
                a, b = p.tail
                self.message[p.region * ALIGN:][:b - a] = self.image[self._at(p, a):self._at(p, b)]
        return self.message

    def fill(self, messages: list[torch.Tensor], header: bytes) -> None:
        """Copy every other piece's tail that falls in a block this rank writes into place in front of its
        piece (messages[r]: rank r's `tails()`; the header's bytes are the header tail)."""
        for p in self.mine:
            if p.blocks is None:
                continue
            lo, hi = p.blocks
            for q in self.pieces:
                if q is p or q.tail is None or not (lo <= q.tail[0] < hi):
                    continue
                a, b = q.tail
                src = (torch.frombuffer(bytearray(header), dtype=torch.uint8) if q.rank == HEADER
                       else messages[q.rank][q.region * ALIGN:][:b - a])
                self.image[self._at(p, a):self._at(p, b)] = src

    def writes(self) -> list[tuple[int, memoryview]]:
        """(file offset, bytes) of every block this rank writes, in file order, each run aligned throughout."""
        mem = memoryview(self.image.numpy()).cast("B")
        return [(p.blocks[0], mem[self._at(p, p.blocks[0]):self._at(p, p.blocks[1])])
                for p in self.mine if p.blocks is not None]

    @property
    def writes_last_block(self) -> bool:
        """Whether this rank writes the file's last block (and so cuts the file to S after it)."""
        return any(p.end == p.size for p in self.mine)
