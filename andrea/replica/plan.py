"""What the replicator decides (replica/replicator.py carries it out): when to try the store again, which
checkpoints a pass sends, which of the replica's it drops, and what to say. Plain functions over plain data and
an injected clock; reads and writes nothing.

A pass sends the newest local checkpoint and every keep_every milestone the replica lacks (`upload_plan`): at a
real cadence (one checkpoint per pass) that is every checkpoint; when they land faster than the store takes them
(a slow uplink, an outage) the store's time goes to the newest state, not to copies the replica's retention
(`remote_victims`, the run's own keep_last / keep_every) would delete at the next pass. A rollback or a resume to
step S abandons the replica's checkpoints above S (`superseded`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from andrea.rundir import checkpoint as ckpt
from andrea.replica.store import ReplicaError


def retry_delay(failures: int, base: float = 1.0, cap: float = 60.0) -> float:
    """Seconds before the next try after `failures` consecutive failed passes: base·2^(failures-1), capped."""
    return 0.0 if failures <= 0 else min(cap, base * 2.0 ** min(failures - 1, 30))


def upload_plan(local: Iterable[int], remote: Iterable[int], keep_every: int) -> list[int]:
    """Local checkpoints to upload, newest first: the newest one and every keep_every milestone (those the run
    keeps for good), when the replica lacks them. A checkpoint that a newer one superseded before a pass reached it
    is not sent (module docstring)."""
    local = sorted(set(local))
    wanted = {s for s in local if keep_every and s % keep_every == 0} | set(local[-1:])
    return sorted(wanted - set(remote), reverse=True)


def superseded(remote: Iterable[int], step: int) -> list[int]:
    """The replica's checkpoints of an abandoned timeline: those above the step the run went back to."""
    return sorted(s for s in remote if s > step)


def remote_victims(remote: Iterable[int], keep_last: int, keep_every: int) -> list[int]:
    """The replica's retention: the run's own rule over its published checkpoints."""
    return ckpt.retention_victims(remote, keep_last, keep_every)


@dataclass
class Health:
    """Failing or not, and what to say: one line when the store starts failing or the problem changes, one when
    it is back. `clock` is injected (tests run it without sleeping)."""
    base: float = 1.0
    cap: float = 60.0
    failures: int = 0
    next_try: float = 0.0
    said: str | None = None  # the kind of problem last said
    error: str | None = None

    def failed(self, e: ReplicaError, now: float) -> str | None:
        """Record a failed pass; the warning line to log, or None when this problem was already said."""
        self.failures += 1
        self.next_try = now + retry_delay(self.failures, self.base, self.cap)
        self.error = str(e)
        if self.said == e.kind:
            return None
        self.said = e.kind
        return f"{e}; training goes on, the replica retries with backoff and catches up when it can"

    def succeeded(self) -> str | None:
        back = self.failures > 0
        self.failures, self.next_try, self.said, self.error = 0, 0.0, None, None
        return "replica reachable again: caught up" if back else None

    def due(self, now: float) -> bool:
        return now >= self.next_try
