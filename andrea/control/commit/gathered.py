"""The checkpoint commit of ZeRO-1 ranks that do not share a run directory: rank 0 gathers, then writes alone.

Writes `step_NNNNNN.bin` and its checksum in rank 0's run directory only, through the one-process path
(`checkpoint_write.commit_image`: spare, O_DIRECT, `step_NNNNNN.sum.json`, rename, directory fsync), and what
`before_commit` owes beside it; the other ranks write nothing into their own run directories, so no rank ever
leaves a `.tmp` there and rank 0 never renames a file another rank wrote (control/parallel/sharing.py decides when).

Each rank r holds the slice [lo_r, hi_r) of w, m and v (andrea/control/parallel/zero.py). Rank 0's staging buffer is a whole
file image (control/commit/writer.py), its own slices being views into it at their offsets; rank r > 0's is its three
slices, back to back. The commit, on every rank's I/O thread, over the `io` group:
    rank r > 0   send w[lo:hi], m[lo:hi], v[lo:hi] to rank 0, then wait for the verdict
    rank 0       receive every rank's slices into the image at their offsets (12·(n - (hi_0 - lo_0)) bytes per
                 checkpoint cross the network), then CheckpointWriter's own commit (before_commit, the image,
                 its checksum, the rename, retention)
    verdict      rank 0 to every rank: 0 committed, 1 failed; every rank keeps the same `last_committed`
Cost against the sharded commit: the gather's bytes, rank 0's disk writing the whole file, and rank 0 holding
two whole images (2·12·n bytes of host memory) instead of two slices.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from andrea.control.commit.writer import CheckpointWriter, CommitFailed, aligned_host_buffer
from andrea.control.parallel.distributed import World
from andrea.rundir import checkpoint as ckpt, names
from andrea.rundir.retention import Retention


def image_views(image: torch.Tensor, n: int, lo: int, hi: int) -> tuple[torch.Tensor, ...]:
    """w[lo:hi], m[lo:hi], v[lo:hi] as fp32 views into a whole-file image (uint8; [w | m | v] at byte 8)."""
    flat = image[ckpt.HEADER.size:ckpt.HEADER.size + 12 * n].view(torch.float32)
    return tuple(flat[region * n + lo:region * n + hi] for region in range(3))


def gather_slices(world: World, n: int, mine: tuple[torch.Tensor, ...], image: torch.Tensor | None) -> None:
    """Rank r > 0: send its slices `mine`; rank 0: receive every rank's into `image` (its own are in place)."""
    if not world.leader:
        for view in mine:
            if view.numel():
                world.send(view, 0, "io")
        return
    for r in range(1, world.size):
        lo, hi = world.shard_bounds(n, r)
        if hi > lo:
            for view in image_views(image, n, lo, hi):
                world.recv(view, r, "io")


class GatheredCheckpointWriter(CheckpointWriter):
    """CheckpointWriter whose snapshot is this rank's slices and whose commit gathers them on rank 0."""

    def __init__(self, run_dir: Path, n: int, world: World, device: torch.device, io, *,
                 retention: Retention, direct: bool = True):
        lo, hi = world.shard_bounds(n)  # the ZeroTrainer's slice (the run's cuts, if any)
        pinned = device.type == "cuda"
        # Rank 0: the base's two whole images. The others: a 1-parameter placeholder (one 4 KiB page) keeps the
        # base's bookkeeping (slots, results, back-pressure) without a whole image.
        super().__init__(run_dir, n if world.leader else 1, device, io, retention=retention, direct=direct)
        self.total_n, self.world, self.rank, self.owns_files = n, world, world.rank, world.leader
        if world.leader:
            self.staging = [image_views(image, n, lo, hi) for image in self.images]
        else:
            k = hi - lo
            self.slices = [aligned_host_buffer(max(12 * k, 4), pinned).view(torch.float32)[:3 * k] for _ in range(2)]
            self.staging = [tuple(buf.split(k)) if k else (buf, buf, buf) for buf in self.slices]

    def _write(self, slot: int, step: int, before_commit: Callable[[], None] | None,
               before_rename: Callable[[], None] | None) -> Path:
        """Rank r > 0 sends its slices and waits for the verdict; rank 0 gathers them into the image and commits
        it as one process does, then sends the verdict (whatever happened: no rank is left waiting for it)."""
        if not self.world.leader:
            gather_slices(self.world, self.total_n, self.staging[slot], None)
            final = self.run_dir / names.checkpoint_name(step)
            if self.world.from_leader(0):
                raise CommitFailed(f"{final}: checkpoint write failed on rank 0: see its log")
            return final
        landed = False
        try:
            gather_slices(self.world, self.total_n, self.staging[slot], self.images[slot])
            path = super()._write(slot, step, before_commit, before_rename)
            landed = True
            return path
        finally:
            self.world.from_leader(0 if landed else 1)
