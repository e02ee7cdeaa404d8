"""What the replicator decides (control/replica/replicator.py carries it out): when to try the store again, which
checkpoints a pass sends, which of the replica's it drops, whether an outage is still open on the record, and what
to say; and what a start decides of its replica (control/replica/admit.py and owner.py carry it out): whether it is
off the run's disk, who holds its claim, and whether its owner record is this run's. Plain functions over plain
data and an injected clock; reads and writes nothing.

A pass sends the newest local checkpoint and every one the run keeps for good that the replica lacks
(`upload_plan`: the keep_every milestones, the keep_best ones, the spared ones such as the divergence guard's
known-good point, which a run restored from the replica rolls back to): at a real cadence (one checkpoint per
pass) that is every checkpoint; when they land faster than the store takes them (a slow uplink, an outage) the
store's time goes to the newest state, not to copies the replica's retention (the run's own policy,
rundir/retention.py, over the replica's checkpoints) would delete at the next pass.
A rollback or a resume to step S abandons the replica's checkpoints above S (`superseded`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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
    said: str | None = None  # the kind of problem last said (in this process's log)
    recorded: str | None = None  # the kind of problem of the replica_down last on the record
    error: str | None = None
    down_since: float | None = None  # the first failed pass of the outage in progress

    def failed(self, e: ReplicaError, now: float) -> str | None:
        """Record a failed pass; the warning line to log (and, when `record` says so, the replica_down marker to
        write), or None when this problem was already said."""
        if self.failures == 0:
            self.down_since = now
        self.failures += 1
        self.next_try = now + retry_delay(self.failures, self.base, self.cap)
        self.error = str(e)
        if self.said == e.kind:
            return None
        self.said = e.kind
        return f"{e}; training goes on, the replica retries with backoff and catches up when it can"

    def record(self, kind: str) -> bool:
        """Whether a problem just said (`failed`) is a replica_down marker to write: not when the outage open on the
        record already names it (`inherit`)."""
        due, self.recorded = self.recorded != kind, kind
        return due

    def succeeded(self) -> str | None:
        """Record a pass that succeeded; the line to log (and the replica_back marker to write) after an outage."""
        back = self.failures > 0
        self.failures, self.next_try, self.said, self.error, self.down_since = 0, 0.0, None, None, None
        self.recorded = None
        return "replica reachable again: caught up" if back else None

    def inherit(self, outage: Sequence[dict], now: float, wall: float) -> None:
        """Start failing, as a previous process left the record (`outage`: `open_outage`'s markers): its problem on
        the record (a first pass that fails the same way says so in this process's log but writes no second
        replica_down; one that succeeds says the replica is back, and the record gets the replica_back that closes
        the outage), down since its first marker's time (`wall`: the time now; `now`: the clock's). No outage:
        nothing changes."""
        if not outage:
            return
        self.failures = max(self.failures, 1)
        self.recorded, self.error = outage[-1].get("problem"), outage[-1].get("error")
        began = outage[0].get("time")
        since = now - max(0.0, wall - began) if isinstance(began, (int, float)) else now
        self.down_since = since if self.down_since is None else min(self.down_since, since)

    def outage_s(self, now: float) -> float:
        """Seconds since the outage in progress began (0 when there is none)."""
        return 0.0 if self.down_since is None else max(0.0, now - self.down_since)

    def due(self, now: float) -> bool:
        return now >= self.next_try


def open_outage(entries: Iterable[dict], uri: str) -> list[dict]:
    """The `replica_down` markers (oldest first) of an outage of the replica at `uri` still open on the record
    (`entries`: the ledger's, oldest first): those after its last `replica_back`; [] when none is open. A process
    that ended with its replica down leaves its outage open; the next one that reaches the store closes it.
    Every marker counts, superseded or not: a resume or a rollback takes the run back, not the store, and leaves
    an outage it did not end open."""
    found: list[dict] = []
    for e in entries:
        if e.get("uri") == uri and e.get("event") == "replica_down":
            found.append(e)
        elif e.get("uri") == uri and e.get("event") == "replica_back":
            found = []
    return found


def stop_line(uri: str, caught_up: bool, replica_step: int | None, newest: int | None, waited_s: float,
              failing: bool) -> str:
    """What a stop says of its replica after waiting `waited_s` seconds for the last pass (`caught_up`: it
    succeeded; `failing`: the store's last answer was a failure, said already when it began), `replica_step` the
    replica's newest checkpoint and `newest` the run's: one line, true of the replica whichever way the wait ended."""
    if caught_up:
        if replica_step is None:
            return f"replica {uri}: up to date at the stop (no checkpoint yet; the ledger and the run's files)"
        return f"replica {uri}: up to date at the stop: holds step {replica_step}" + \
            (", the newest checkpoint" if replica_step == newest else f" (the newest checkpoint is step {newest})")
    why = f"the store still failing after a {waited_s:.0f} s wait" if failing else \
        f"its last pass not done after a {waited_s:.0f} s wait"
    if replica_step is not None and replica_step == newest:
        return (f"replica {uri}: holds the newest checkpoint (step {newest}) but not the ledger's and the run's "
                f"files' last changes, {why}; the next start sends them")
    held = "no checkpoint" if replica_step is None else f"step {replica_step}"
    return (f"replica {uri}: behind at the stop: holds {held}, the newest checkpoint is "
            f"{'none' if newest is None else f'step {newest}'}, {why}; the next start uploads what is missing")


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


OWNER_KEYS = ("started", "identity", "branched")  # what every owner record names of its run's start marker


def same_run(remote: dict, local: dict) -> bool:
    """Whether the owner record `remote` names the run whose record is `local` (admit.py's `record_of`): the same
    `start` marker (its time, its identity, the time of the branch after it) and, where the record carries one, the
    same run id. Where both carry a run id, it and the branch's time decide: the identity and time beside the id are
    the same marker's, so a bit flipped in them (a changed ledger, which the start then refuses in its own true line,
    campaign seed 201) does not make this run another one. A record written before run ids were recorded has no
    `run`: its other fields decide."""
    if remote.get("run") is not None and local.get("run") is not None:
        return remote["run"] == local["run"] and remote.get("branched") == local.get("branched")
    keys = OWNER_KEYS + (("run",) if "run" in remote else ())
    return all(remote.get(k) == local.get(k) for k in keys)


def owner_verdict(remote: dict | None, local: dict | None, earlier: Sequence[dict], published: Sequence[int]) -> str:
    """What this run may do with a replica whose `replica.json` holds `remote` (None: it has none): "none";
    "starting" (another start's provisional claim); "ours" (this run's record); "again": the record of an earlier
    start of this run directory that published no checkpoint, under this run's identity (a first start that ended
    before its first checkpoint, begun again from step 0 with a new `start` marker and run id: the same run, which
    claims its replica again); or "other" (another run: refused). `local`: this run's record (None before its
    first start); `earlier`: the {"run", "started"} of the start markers before the newest in its ledger
    (admit.py's `earlier_starts`); `published`: the replica's published steps."""
    if remote is None:
        return "none"
    if remote.get("started") is None and isinstance(remote.get("claimed_by"), dict):
        return "starting"
    if local is None:
        return "other"
    if same_run(remote, local):
        return "ours"
    mine = started_here(remote, earlier) and remote.get("identity") == local.get("identity")
    return "again" if mine and not published else "other"


def started_here(remote: dict, earlier: Sequence[dict]) -> bool:
    """Whether an owner record names one of `earlier`, this run directory's earlier start markers: by run id, or by
    the marker's time for a record written before run ids."""
    key = "run" if remote.get("run") is not None else "started"
    return remote.get(key) is not None and any(e.get(key) == remote.get(key) for e in earlier)


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

