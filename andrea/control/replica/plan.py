"""What the replicator decides (control/replica/replicator.py carries it out): when to try the store again, which
checkpoints a pass sends, which of the replica's it drops, and what to say; and what a start decides of its replica
(control/replica/admit.py carries it out): whether it is off the run's disk, and who holds its claim. Plain functions over
plain data and an injected clock; reads and writes nothing.

A pass sends the newest local checkpoint and every one the run keeps for good that the replica lacks
(`upload_plan`: the keep_every milestones, the keep_best ones, the spared ones such as the divergence guard's
known-good point, which a run restored from the replica rolls back to): at a real cadence (one checkpoint per
pass) that is every checkpoint; when they land faster than the store takes them (a slow uplink, an outage) the
store's time goes to the newest state, not to copies the replica's retention (the run's own policy,
rundir/retention.py, over the replica's checkpoints) would delete at the next pass.
A rollback or a resume to step S abandons the replica's checkpoints above S (`superseded`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from andrea.control.replica.remote import ReplicaError
from andrea.rundir import retention
from andrea.rundir.retention import Policy


def retry_delay(failures: int, base: float = 1.0, cap: float = 60.0) -> float:
    """Seconds before the next try after `failures` consecutive failed passes: base·2^(failures-1), capped."""
    return 0.0 if failures <= 0 else min(cap, base * 2.0 ** min(failures - 1, 30))


def upload_plan(local: Iterable[int], remote: Iterable[int], policy: Policy, spared: Iterable[int] = (),
                scores: Mapping[int, float] | None = None) -> list[int]:
    """Local checkpoints to upload, newest first: the newest one and those the policy keeps for good (milestones,
    the best, `spared`: the guard's known-good one, which a rollback after a restore reads), when the replica
    lacks them. A checkpoint that a newer one superseded before a pass reached it is not sent (module
    docstring)."""
    local = sorted(set(local))
    wanted = set(local[-1:]) | retention.kept_for_good(local, policy, spared, scores)
    return sorted(wanted - set(remote), reverse=True)


def superseded(remote: Iterable[int], step: int) -> list[int]:
    """The replica's checkpoints of an abandoned timeline: those above the step the run went back to."""
    return sorted(s for s in remote if s > step)


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
    down_since: float | None = None  # the first failed pass of the outage in progress

    def failed(self, e: ReplicaError, now: float) -> str | None:
        """Record a failed pass; the warning line to log (and the replica_down marker to write), or None when this
        problem was already said."""
        if self.failures == 0:
            self.down_since = now
        self.failures += 1
        self.next_try = now + retry_delay(self.failures, self.base, self.cap)
        self.error = str(e)
        if self.said == e.kind:
            return None
        self.said = e.kind
        return f"{e}; training goes on, the replica retries with backoff and catches up when it can"

    def succeeded(self) -> str | None:
        """Record a pass that succeeded; the line to log (and the replica_back marker to write) after an outage."""
        back = self.failures > 0
        self.failures, self.next_try, self.said, self.error, self.down_since = 0, 0.0, None, None, None
        return "replica reachable again: caught up" if back else None

    def outage_s(self, now: float) -> float:
        """Seconds since the outage in progress began (0 when there is none)."""
        return 0.0 if self.down_since is None else max(0.0, now - self.down_since)

    def due(self, now: float) -> bool:
        return now >= self.next_try


# --- where a replica may be, and who may claim it (the start's checks, control/replica/admit.py) ---
def placement_problem(replica: str, run_dir: str, replica_dev: int | None, run_dev: int | None) -> str | None:
    """Why a plain-path replica (`replica`, `run_dir`: resolved absolute paths; the devices of the nearest existing
    directory of each) is no replica off the run's disk, in words; None when it is on another filesystem."""
    inside = lambda a, b: a == b or a.startswith(b.rstrip("/") + "/")  # noqa: E731
    if replica == run_dir:
        return "is the run directory itself"
    if inside(replica, run_dir):
        return "is inside the run directory"
    if inside(run_dir, replica):
        return "holds the run directory"
    if replica_dev is not None and replica_dev == run_dev:
        return f"is on the run directory's filesystem (device {replica_dev}): one disk failure takes both"
    return None


def claim_holder(remote: dict | None, me: dict, alive: bool) -> str:
    """Who holds the replica's `replica.json`: "none"; "run" (a run's record); a provisional claim, written by a
    start before its run has a record (`claimed_by`: host, pid, run_dir), that is "ours" (this run directory on this
    host: a start that stopped before its first pass), "stale" (its process on this host is gone: `alive` says) or
    "other" (a run starting elsewhere at the same moment)."""
    if remote is None:
        return "none"
    claimant = remote.get("claimed_by") if remote.get("started") is None else None
    if not isinstance(claimant, dict):
        return "run"
    if claimant.get("host") == me["host"] and claimant.get("run_dir") == me["run_dir"]:
        return "ours"
    return "stale" if claimant.get("host") == me["host"] and not alive else "other"

