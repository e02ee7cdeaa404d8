"""checkpoint.keep_best through the real writer (control/commit/writer.py): the checkpoints with the best held-out
losses survive keep_last, read from the held-out history as the evals arrive and as a rollback cuts it back."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from andrea.control.commit.writer import CheckpointWriter
from andrea.control.run.heldout import HeldOut
from andrea.rundir import checkpoint as ckpt
from andrea.rundir.retention import Policy, Retention

N = 16


def commit_all(writer: CheckpointWriter, steps, heldout: HeldOut, losses: dict[int, float]) -> None:
    """Each step committed, then its eval recorded (the boundary's order: the checkpoint, then the audits)."""
    async def go():
        for step in steps:
            slot = await writer.free_slot()
            writer.staging[slot].copy_(torch.from_numpy(np.full(3 * N, float(step), dtype=np.float32)))
            result = await writer.start_commit(slot, step, None)
            assert result.error is None, result.error
            if step in losses:
                heldout.record(step, losses[step])
    asyncio.run(go())


def on_disk(run_dir) -> list[int]:
    return [s for s, _ in ckpt.list_checkpoints(run_dir)]


def test_keep_best_keeps_the_lowest_held_out_losses_beside_keep_last(tmp_path):
    heldout, io = HeldOut(), ThreadPoolExecutor(1)
    writer = CheckpointWriter(tmp_path, N, torch.device("cpu"), io,
                              retention=Retention(Policy(keep_last=1, keep_best=2), heldout.losses))
    try:
        commit_all(writer, [10, 20, 30, 40, 50, 60], heldout, {10: 3.0, 20: 2.2, 30: 2.6, 40: 2.4, 50: 2.9, 60: 3.5})
        assert on_disk(tmp_path) == [20, 40, 60]  # the two best, and the newest (keep_last = 1)
        heldout.cut(30)  # a rollback to 30: the evals of 40.. belong to the abandoned timeline
        commit_all(writer, [70], heldout, {})
        assert on_disk(tmp_path) == [20, 70]  # 40's loss no longer counts; 30 was deleted before
    finally:
        io.shutdown()


def test_without_keep_best_only_keep_last_stays(tmp_path):
    heldout, io = HeldOut(), ThreadPoolExecutor(1)
    writer = CheckpointWriter(tmp_path, N, torch.device("cpu"), io, retention=Retention(Policy(keep_last=1),
                                                                                        heldout.losses))
    try:
        commit_all(writer, [10, 20, 30], heldout, {10: 1.0, 20: 2.0, 30: 3.0})
        assert on_disk(tmp_path) == [30]
    finally:
        io.shutdown()
