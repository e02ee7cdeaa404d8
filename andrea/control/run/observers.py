"""What the step boundary tells the rest of the run: observer hooks, so the parts that react to an eval, a commit,
a rollback or a pivot subscribe instead of being woven into `Boundary.cross` (control/run/boundary.py).

    on_eval(step, val_loss)              a validation loss was measured at `step` (rank 0: the audits are its)
    on_commit(step, commit, state, s)    the checkpoint of `step` was queued: `commit` is its future (a
                                         CommitResult when it lands; add done-callbacks for the outcome), `state`
                                         the bandit's state it carries, `s` the seconds the snapshot stalled
    on_rollback(step)                    the run went back to `step` (a guard rollback, or its give-up); the
                                         abandoned timeline's checkpoints are already deleted
    on_pivot(step, phase, cfg)           a new data policy took effect at `step`
    on_settle(step)                      the boundary is done: `step` is the newest no resume or rollback can go
                                         below (None before any checkpoint)

The subscribers are built where the run is wired (control/run/runtime.py) and handed to the Boundary at
construction, in the order they are told: the guard's and the held-out history's (control/run/heldout.py)
always first, then the views', the replica's, the notices' and the plateau's (control/observe/plateau.py).
All on the event loop's thread; a done-callback runs there too. Reads and writes nothing itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any


class Observer:
    """A subscriber: every hook a no-op unless overridden."""

    def on_eval(self, step: int, val_loss: float) -> None: ...

    def on_commit(self, step: int, commit: asyncio.Future, state: dict, stall_s: float) -> None: ...

    def on_rollback(self, step: int) -> None: ...

    def on_pivot(self, step: int, phase: int, cfg: Any) -> None: ...

    def on_settle(self, step: int | None) -> None: ...


class Observers(Observer):
    """The subscribers, told in order."""

    def __init__(self, subscribers: Iterable[Observer]):
        self.subscribers = list(subscribers)

    def on_eval(self, step, val_loss):
        for s in self.subscribers:
            s.on_eval(step, val_loss)

    def on_commit(self, step, commit, state, stall_s):
        for s in self.subscribers:
            s.on_commit(step, commit, state, stall_s)

    def on_rollback(self, step):
        for s in self.subscribers:
            s.on_rollback(step)

    def on_pivot(self, step, phase, cfg):
        for s in self.subscribers:
            s.on_pivot(step, phase, cfg)

    def on_settle(self, step):
        for s in self.subscribers:
            s.on_settle(step)


def commit_error(fut: asyncio.Future) -> str | None:
    """Why a commit did not land (its result's error, its exception, or "cancelled"); None when it landed."""
    if fut.cancelled():
        return "cancelled"
    if fut.exception() is not None:
        return str(fut.exception())
    return fut.result().error


class GuardCommits(Observer):
    """The divergence guard (control/guard/decisions.py): a failed commit is never confirmed as its good point."""

    def __init__(self, guard):
        self.guard = guard

    def on_commit(self, step, commit, state, stall_s):
        def landed(fut: asyncio.Future) -> None:
            if commit_error(fut) is not None:
                self.guard.on_commit_failed(step)
        commit.add_done_callback(landed)


class ToViews(Observer):
    """TensorBoard and W&B (control/observe/views.py): each checkpoint's scalars, its landing, the settled step."""

    def __init__(self, views):
        self.views = views

    def on_commit(self, step, commit, state, stall_s):
        self.views.add_checkpoint(step, state, stall_s)
        commit.add_done_callback(self.views.on_commit)

    def on_settle(self, step):
        self.views.settle(step)


class ToReplica(Observer):
    """The replica (control/replica/replicator.py): a pass after each commit; a rollback's abandoned timeline
    unpublished at the next pass."""

    def __init__(self, replicator):
        self.replicator = replicator

    def on_commit(self, step, commit, state, stall_s):
        commit.add_done_callback(self.replicator.notify)

    def on_rollback(self, step):
        self.replicator.supersede(step)


class ToNotices(Observer):
    """The boundary's notices (control/observe/notify.py `Notifier.send`): a failed write, a pivot. (The
    markers' notices go out with the ledger's lines: notify.py `lines`.)"""

    def __init__(self, send: Callable[..., None]):
        self.send = send

    def on_commit(self, step, commit, state, stall_s):
        def landed(fut: asyncio.Future) -> None:
            error = commit_error(fut)
            if error is not None:
                self.send("write_error", step, message=error, error=error, disk_full="No space left" in error)
        commit.add_done_callback(landed)

    def on_pivot(self, step, phase, cfg):
        self.send("pivot", step, message=f"pivot at step {step}: phase {phase}", phase=phase,
                  caps=cfg.policy.caps, floors=cfg.policy.floors)
