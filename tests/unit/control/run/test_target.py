"""Under torchrun the target is read once, by rank 0, and every rank follows it (control/run/target.py: agreed):
on separate disks only rank 0's directory holds the run's checkpoints, so a rank deciding from its own would end
alone, or train alone, while its peers wait for it in a collective."""

from __future__ import annotations

import queue
import threading

import numpy as np

from andrea.control.run import target
from andrea.rundir.checkpoint_write import commit_checkpoint
from tests.sharding import ThreadWorld


def agreed_on_two_ranks(dirs, steps: int) -> list:
    box, sync, mail = {}, threading.Barrier(2, timeout=30), [queue.Queue(), queue.Queue()]
    out = [None, None]

    def rank(r):
        out[r] = target.agreed(dirs[r], steps, ThreadWorld(r, 2, box, sync, mail))
    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def test_every_rank_takes_rank_0s_reading_of_the_target(tmp_path):
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir(), node1.mkdir()
    commit_checkpoint(node0, 7, np.zeros(30, dtype=np.float32))  # the run, on node 0's disk; node 1's holds none
    assert agreed_on_two_ranks([node0, node1], 7) == [7, 7]  # at its target: every rank ends
    assert agreed_on_two_ranks([node0, node1], 8) == [None, None]  # below it: every rank trains
    # a stale copy on node 1 at its target is never read: rank 0's directory has nothing yet
    assert agreed_on_two_ranks([node1, node0], 7) == [None, None]
