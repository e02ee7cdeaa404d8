"""TensorBoard scalars for a run (`log.tensorboard = true`): the ledger's records, written under RUN_DIR/tb/.

Fed with exactly the dicts the runtime hands to the ledger (control/run/ledger_feed.py: step entries and markers), plus
each checkpoint's bandit state and commit result. Tags, all with the header step as global step (stored as
float32): the ledger's scalars as control/observe/scalars.py names them (train/loss, lr, grad_norm, mfu, tokens_per_s;
val/loss, val/target_loss, val/<arm>; tasks/acc, acc_norm, acc_norm_chars), and

    data/share/<arm>       the bandit's mixture at each checkpoint (the `shares` of step_S.state.json)
    checkpoint/stall_s     the training loop's stall for the snapshot of step S
    checkpoint/commit_s    the I/O thread's time to commit step_S.bin (ledger fsync and sidecars included)
    replica/lag_steps      after each replica pass (control/replica/replicator.py), at the newest local checkpoint's step:
    replica/lag_s          the steps and seconds by which the replica's newest checkpoint trails it (0: caught up)

Thread: one `andrea-tb` thread owns the SummaryWriter (which queues to its own file-writer thread). The event
loop only submits to that thread's unbounded queue, so a slow or stalled disk under tb/ delays the scalars,
never a step. A write error is logged once and TensorBoard output stops; the run goes on (the ledger is the
record, TensorBoard a view of it). Under data parallelism only the process that writes the ledger opens it.

Resume: a process that starts at header step S opens its writer with `purge_step = S + 1`, which writes a
SessionLog START marker; TensorBoard's Python loader then hides every point at a step > S written by earlier
processes, the same entries `ledger.history` supersedes (a crash after step S lost its checkpoint, so steps above
S ran again). Points at steps <= S stay. (TensorBoard's Rust data server ignores the marker but reaches the same
view per tag: a point at step s preempts the earlier points of that tag at steps >= s.) A `rollback` marker (the divergence guard went back to step G within the
process) reopens the writer with `purge_step = G + 1`, to the same effect. A branch directory gets its own tb/,
starting at the branch step.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from andrea.config.outputs import LogConfig
from andrea.control.observe.scalars import LedgerScalars
from andrea.rundir.names import TB_DIR

log = logging.getLogger("andrea.tensorboard")


class TensorBoardLog:
    def __init__(self, run_dir: Path, start_step: int, flush_secs: float, log_every: int):
        self.dir = run_dir / TB_DIR
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="andrea-tb")
        self.writer = None
        self.failed = False
        self.scalars = LedgerScalars(log_every)
        self.thread.submit(self._guard, self._open, start_step + 1, flush_secs)

    # --- called on the event loop: never blocks ------------------------------------------------------------
    def add_records(self, lines: list[dict[str, Any]]) -> None:
        """Ledger lines, in ledger order (the caller does not mutate them afterwards)."""
        self.thread.submit(self._guard, self._records, lines)

    def add_checkpoint(self, step: int, state: dict[str, Any], stall_s: float) -> None:
        self.thread.submit(self._guard, self._checkpoint, step, dict(state.get("shares") or {}), stall_s)

    def on_commit(self, fut) -> None:
        """Done-callback of a commit future (a control/commit/writer.py CommitResult)."""
        if fut.cancelled() or fut.exception() is not None:
            return
        result = fut.result()
        if result.error is None:
            self.thread.submit(self._guard, self._scalar, "checkpoint/commit_s", result.seconds, result.step)

    def add_replica(self, step: int, lag_steps: int, lag_s: float) -> None:
        """The replica's lag after a pass (called on the replicator's thread: only submits)."""
        self.thread.submit(self._guard, self._scalar, "replica/lag_steps", lag_steps, step)
        self.thread.submit(self._guard, self._scalar, "replica/lag_s", lag_s, step)

    def settle(self, step: int) -> None:
        """Nothing to hold back: TensorBoard takes each step as it comes, and steps run again after a rollback or a
        resume hide the old ones (purge_step, module docstring)."""

    def close(self, settled: int | None = None) -> None:
        """Flush and close (waits for the queue: called once, at the end of the run)."""
        self.thread.submit(self._guard, self._close)
        self.thread.shutdown(wait=True)

    # --- the andrea-tb thread ------------------------------------------------------------------------------
    def _guard(self, fn, *args) -> None:
        if self.failed:
            return
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001  (a view of the ledger must never take the run down)
            self.failed = True
            log.error("%s: TensorBoard output stopped (the ledger is unaffected): %s", self.dir, e)

    def _open(self, purge_step: int, flush_secs: float) -> None:
        self.flush_secs = flush_secs
        from torch.utils.tensorboard import SummaryWriter  # imported only when enabled
        self.writer = SummaryWriter(str(self.dir), purge_step=purge_step, flush_secs=flush_secs, max_queue=1000)

    def _scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)

    def _records(self, lines: list[dict[str, Any]]) -> None:
        for e in lines:
            if e.get("event") == "rollback":  # the guard went back to step G in this process: hide what follows G
                self.writer.close()
                self._open(e["step"] + 1, self.flush_secs)
            for tag, value in self.scalars.of(e):
                self._scalar(tag, value, e["step"])

    def _checkpoint(self, step: int, shares: dict[str, float], stall_s: float) -> None:
        for arm, share in shares.items():
            self._scalar(f"data/share/{arm}", share, step)
        self._scalar("checkpoint/stall_s", stall_s, step)

    def _close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def open_log(cfg: LogConfig, run_dir: Path, start_step: int, log_every: int) -> TensorBoardLog | None:
    """The run's TensorBoard writer, or None when `log.tensorboard` is off."""
    return TensorBoardLog(run_dir, start_step, cfg.flush_secs, log_every) if cfg.tensorboard else None
