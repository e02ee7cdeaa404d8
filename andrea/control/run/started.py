"""A run once it has started: what `TrainingRun.start` (control/run/runtime.py) builds and hands to the `Boundary`.

One object instead of attributes set one by one after `__init__`: before `start` returns there is no started
run, after it every part below exists. Reads and writes nothing itself.
"""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from andrea.control.commit.writer import CheckpointWriter
    from andrea.config.schema import RunConfig
    from andrea.data.codec import TextCodec
    from andrea.evals.audit import TaskAudit
    from andrea.control.guard.decisions import Guard
    from andrea.control.mixture.proxy import DataProxy
    from andrea.control.observe.mfu import Meter
    from andrea.control.observe.views import Views
    from andrea.control.parallel.distributed import World
    from andrea.control.parallel.ranks import FollowerLedger
    from andrea.control.replica.replicator import Replicator
    from andrea.control.run.heldout import HeldOut
    from andrea.control.run.ledger_feed import LedgerFeed
    from andrea.control.run.trainer import Trainer
    from andrea.rundir.ledger import LossLedger
    from andrea.rundir.retention import Retention


@dataclass
class Started:
    """The started run's parts. `step`, `cfg` and `proxy` are where it started: the Boundary carries them on (a
    pivot replaces the configuration and the proxy, a rollback moves the step back)."""

    cfg: RunConfig  # the configuration in force at the start
    run_dir: Path
    world: World  # torchrun's ranks (control/parallel/distributed.py); one process: no-ops
    step: int  # header step of the state the trainer holds: 0, or the checkpoint resumed from
    trainer: Trainer  # or control/parallel/zero.py's ZeroTrainer
    proxy: DataProxy  # the data: its phase, policy and batches (control/mixture/proxy.py)
    writer: CheckpointWriter  # or the sharded / gathered one (control/commit/shards.py, control/commit/gathered.py)
    guard: Guard  # control/guard/decisions.py: the known-good point and the gate on commits
    ledger: LossLedger | FollowerLedger  # rank 0 writes the ledger; on the other ranks appends are dropped
    feed: LedgerFeed  # the ledger's lines, written on the I/O thread (control/run/ledger_feed.py)
    codec: TextCodec | None  # the tokenizer, for the sample audits
    tasks: TaskAudit | None  # eval.tasks, scored at its cadence (rank 0, when configured)
    meter: Meter | None  # tokens/s and MFU over the last steps (control/observe/mfu.py)
    train: Executor  # the training thread: the model's only user
    io: Executor  # the FIFO I/O thread: every file write, in submission order
    heldout: HeldOut  # the validation losses of the effective timeline (control/run/heldout.py; empty off rank 0)
    retention: Retention  # the one retention policy, the writer's and the replica's (rundir/retention.py)
    views: Views | None = None  # log.tensorboard, log.wandb: the ledger's lines as scalars (rank 0, when on)
    replicator: Replicator | None = None  # checkpoint.replica: copies off the machine (rank 0, when set)
