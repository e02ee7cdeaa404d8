"""Test helpers for the sharded (ZeRO-1) commit: ranks as threads of one process, and the tolerances by which
two ranks and one process agree.
"""

from __future__ import annotations

import errno
import os
import pickle
import queue
import threading

import numpy as np
import torch

from andrea.control.commit.shard_layout import ShardImage
from andrea.control.commit.shards import ShardFailure, commit_shards
from andrea.control.parallel.distributed import World, shard_bounds
from andrea.rundir import names, spare
from andrea.rundir.checkpoint_write import DIRECT_ALIGN, DirectIO, commit_checkpoint

# Per-step agreement between 2 ranks and 1 process. Only the order of float32 reductions differs (the gradient
# mean over ranks, the global norm summed from slices in fp64, the loss mean over gathered rows); fp32 carries
# 2^-24 ~ 6e-8 relative. At step 1 (identical weights) that is all there is: the grad norms agree to ~1e-6
# (NORM_AT_START). The last-bit differences then ride through the updates and grow with the trajectory (how fast
# depends on the data and the CPU's vector kernels, so this bounds a property, not a course): over 60 steps at the
# tiny preset's peak lr the loss has stayed within 3e-5 relative and the gradient norm, far more sensitive to the
# weights, within 4e-3 (measured on two machines and two data layouts). The bounds leave 3-5x room; a wrong
# shard, row split or missing average is off by O(1).
LOSS_RTOL, NORM_RTOL, NORM_AT_START = 1e-4, 2e-2, 1e-5


class ThreadWorld(World):
    """P ranks as threads of this process, so the sharded commit's protocol runs as written, without processes:
    the all-gather is barrier-based, and a point-to-point message is a put into the receiver's queue (a sender
    goes on, a receiver waits: as gloo's send and recv). Objects travel pickled, as torch.distributed's do."""

    def __init__(self, rank: int, size: int, box: dict, barrier: threading.Barrier, mail: list[queue.Queue],
                 pairs: dict | None = None):
        super().__init__(rank, size, rank)
        self.box, self.sync, self.mail = box, barrier, mail
        self.pairs = pairs if pairs is not None else {}  # (src, dst) -> the tensors sent, in order

    def _pair(self, src: int, dst: int) -> queue.Queue:
        return self.pairs.setdefault((src, dst), queue.Queue())  # atomic under the GIL

    def send(self, t: torch.Tensor, to: int, group: str) -> None:
        self._pair(self.rank, to).put(t.clone())

    def recv(self, t: torch.Tensor, src: int, group: str) -> None:
        got = self._pair(src, self.rank).get(timeout=30)
        assert got.shape == t.shape and got.dtype == t.dtype, (got.shape, t.shape)
        t.copy_(got)

    def barrier(self) -> None:
        self.sync.wait()

    def gather(self, obj):
        self.box[self.rank] = pickle.dumps(obj)
        self.sync.wait()
        out = [pickle.loads(self.box[r]) for r in range(self.size)]
        self.sync.wait()
        return out

    def max_ints(self, values: list[int], group: str = "control") -> list[int]:
        return [max(column) for column in zip(*self.gather(list(values)))]

    def broadcast(self, obj):
        return self.gather(obj if self.leader else None)[0]

    def broadcast_tensor(self, t: torch.Tensor, group: str = "control") -> None:
        if self.leader:
            self.box[0] = t.clone()
        self.sync.wait()
        if not self.leader:
            t.copy_(self.box[0])
        self.sync.wait()

    def to_leader(self, value: int, group: str = "io") -> list[int] | None:
        if not self.leader:
            self.mail[0].put((self.rank, value))
            return None
        got = dict(self.mail[0].get(timeout=30) for _ in range(self.size - 1))
        return [value] + [got[r] for r in range(1, self.size)]

    def from_leader(self, value: int, group: str = "io") -> int:
        if self.leader:
            for r in range(1, self.size):
                self.mail[r].put((0, value))
            return value
        return self.mail[self.rank].get(timeout=30)[1]

    def all_gather_bytes(self, t: torch.Tensor, group: str = "io") -> list[torch.Tensor]:
        self.box[self.rank] = t.clone()
        self.sync.wait()
        out = [self.box[r] for r in range(self.size)]
        self.sync.wait()
        return out


def commit_with_threads(tmp_path, n: int, size: int, payload: np.ndarray, fail_rank: int | None = None,
                        returned: dict | None = None, **hooks):
    box, barrier, errors = {}, threading.Barrier(size, timeout=30), {}  # a rank that never arrives breaks it
    mail = [queue.Queue() for _ in range(size)]
    direct = [DirectIO(True) for _ in range(size)]

    def rank(r: int) -> None:
        lo, hi = shard_bounds(n, size, r)
        image = ShardImage(n, size, r, pinned=False)
        for view, region in zip(image.views, range(3)):
            view.copy_(torch.from_numpy(payload[region * n + lo:region * n + hi]))
        for off, view in image.writes():  # what O_DIRECT needs: offset, length and host address on a block boundary
            addr = np.frombuffer(view, dtype=np.uint8).ctypes.data
            assert off % DIRECT_ALIGN == len(view) % DIRECT_ALIGN == addr % DIRECT_ALIGN == 0
        if r == fail_rank:
            def broken():
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            image.writes = broken  # this rank's write fails
        try:
            commit_shards(ThreadWorld(r, size, box, barrier, mail), tmp_path, 7, n, image, direct[r], **hooks)
        except ShardFailure as e:
            errors[r] = str(e)
        if returned is not None:
            returned[r].set()

    on_threads(size, rank)
    return errors


def on_threads(size: int, rank) -> None:
    """rank(r) for r < size, each on a thread named rank-r; all joined (a rank lost for 60 s fails the test)."""
    threads = [threading.Thread(target=rank, args=(r,), name=f"rank-{r}") for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not [t.name for t in threads if t.is_alive()], "a rank thread still runs after 60 s (a lost message?)"


def released_spare(tmp_path, n: int) -> int:
    """A checkpoint of another step, committed and released by retention: the run directory's spare (inode)."""
    old = commit_checkpoint(tmp_path, 3, np.ones(3 * n, dtype=np.float32))
    assert spare.retire(old)
    for companion in names.companions(tmp_path, 3):  # as the writer's retention does
        companion.unlink()
    return (tmp_path / names.SPARE_NAME).stat().st_ino


def run_ranks(size: int, fn) -> dict[int, object]:
    """fn(world) on `size` ranks as threads (ThreadWorld); rank -> what it returned, or the exception it raised."""
    box, barrier, mail, pairs, out = {}, threading.Barrier(size, timeout=30), [queue.Queue() for _ in range(size)], \
        {}, {}

    def rank(r: int) -> None:
        try:
            out[r] = fn(ThreadWorld(r, size, box, barrier, mail, pairs))
        except Exception as e:  # noqa: BLE001 - the test asserts on it
            out[r] = e

    on_threads(size, rank)
    return out
