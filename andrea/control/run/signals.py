"""What operators ask of a running trainer (docs/operating.md), and the decision of what to do at each step boundary.

Signals only record a request here; the runtime acts at step boundaries:
    SIGTERM, SIGINT   finish the step in flight, checkpoint it, flush ledger and sidecars, exit 0.
                      A second SIGINT aborts at once (the last committed checkpoint stays valid).
    SIGUSR1           finish the step in flight, checkpoint it, keep training. Requests that arrive before
                      that checkpoint is taken coalesce into one. With checkpoint.usr1 = "cadence" the
                      checkpoint is taken at the next multiple of checkpoint.every instead (docs/operating.md).
    SIGHUP            hot policy pivot: checkpoint (same alignment as SIGUSR1), then switch the data policy.

`Requests` and `boundary_action` are plain state and a plain function: tested without signals or sleeping.
`install_handlers` / `remove_handlers` wire them to an asyncio loop (`loop.add_signal_handler`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("andrea.signals")

HANDLED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)


@dataclass
class Requests:
    stop: str | None = None  # name of the signal that asked to stop
    interrupts: int = 0
    checkpoint_at: int | None = None  # step at which a requested checkpoint is due (None: none pending)
    checkpoint_asked: int = 0  # signals received for it, coalesced
    landing: int | None = None  # step of a requested checkpoint taken but not yet committed
    pivot: bool = False
    policy: object = None  # the RunConfig a pending pivot switches to (read from policy.next.toml at SIGHUP)
    failed: str | None = None  # why the run ends with exit 1 at this boundary (a failed write, stop policy)
    received: list[str] = field(default_factory=list)

    def ask_checkpoint(self, current_step: int, every: int, align: str) -> bool:
        """Record a SIGUSR1/SIGHUP checkpoint request; False when it coalesced into one not yet landed."""
        self.checkpoint_asked += 1
        if self.checkpoint_at is not None or self.landing is not None:
            return False
        self.checkpoint_at = checkpoint_target(current_step, every, align)
        return True

    def ask_pivot(self, current_step: int, every: int, align: str) -> None:
        """Record a SIGHUP pivot: it needs a checkpoint of its own, taken after the request — one already
        landing predates it, so unlike SIGUSR1 it does not coalesce into that one."""
        self.pivot = True
        self.checkpoint_asked += 1
        if self.checkpoint_at is None:
            self.checkpoint_at = checkpoint_target(current_step, every, align)

    @property
    def pending_step(self) -> int | None:
        """The step of the requested checkpoint not yet taken, else of the one taken but not yet landed."""
        return self.checkpoint_at if self.checkpoint_at is not None else self.landing


def checkpoint_target(current_step: int, every: int, align: str) -> int:
    """Step whose state a requested checkpoint holds: the step in flight finishes at current_step + 1."""
    nxt = current_step + 1
    return nxt if align == "step" else -(-nxt // every) * every


@dataclass(frozen=True)
class Action:
    checkpoint: bool = False
    reason: str = ""
    stop: bool = False
    pivot: bool = False


def boundary_action(step: int, stop_at: int, every: int, req: Requests) -> Action:
    """What to do now that the state is at header step `step` (updates completed)."""
    reasons = []
    if req.stop is not None:
        reasons.append(req.stop)
    if step >= stop_at:
        reasons.append("final step")
    if step % every == 0 and step > 0:
        reasons.append("cadence")
    due = req.checkpoint_at is not None and step >= req.checkpoint_at
    if due:
        reasons.append("pivot" if req.pivot else "SIGUSR1")
    stop = req.stop is not None or step >= stop_at
    return Action(checkpoint=bool(reasons), reason=", ".join(reasons), stop=stop, pivot=due and req.pivot)


def install_handlers(loop: asyncio.AbstractEventLoop, on_signal: Callable[[signal.Signals], None]) -> None:
    for sig in HANDLED:
        loop.add_signal_handler(sig, on_signal, sig)


def remove_handlers(loop: asyncio.AbstractEventLoop) -> None:
    for sig in HANDLED:
        loop.remove_signal_handler(sig)


def abort_now() -> None:
    """Second SIGINT: leave at once. Commits are atomic, so the last committed checkpoint stays valid."""
    log.warning("second SIGINT: aborting now without a final checkpoint")
    logging.shutdown()
    os._exit(130)
