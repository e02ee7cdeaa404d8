"""Whether a run may use its replica, decided at its start before it writes anything in its run directory, and
the run's record of itself that the replica's owner record holds (control/replica/owner.py's `replica.json`).

Reads the run's ledger (its `start` markers: `record_of`, `earlier_starts`), its checkpoints' checksums (the run id
they vouch for, when the ledger's start marker is unreadable: `vouched_run`), the replica's `replica.json` and
listing, and the devices of the run directory and of a plain-path replica; writes, in the replica only, a test
object (put, then deleted) and `replica.json`: the run's record, or for a run not started yet a provisional claim
`{"format": 1, "claimed_by": {"host", "pid", "run_dir"}}` that the replicator's first pass replaces with the record
(control/replica/replicator.py). The decisions are control/replica/plan.py's (`placement_problem`, `claim_holder`,
`owner_verdict`).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from andrea.control.replica import owner, remote as rep
from andrea.control.replica.plan import claim_holder, placement_problem
from andrea.rundir import checksum
from andrea.rundir.ledger import readable_entries
from andrea.rundir.names import LEDGER_NAME, step_of


class ReplicaPlacementError(rep.ReplicaError):
    """A plain-path replica on the run's own disk: a configuration to fix (exit 2), refused before any write."""

    exit_code = 2


def run_record(run_dir: Path) -> dict | None:
    """This run's owner record (`record_of` its ledger and `vouched_run`); None before the run has a start marker."""
    return record_of(readable_entries(run_dir / LEDGER_NAME), vouched_run(run_dir))


def vouched_run(run_dir: Path) -> str | None:
    """The run id that this run directory's newest checkpoint with one vouches for (its checksum's `run`); None when
    none does (no checkpoint yet, or a run from before ids)."""
    checkpoints = [p.with_name(p.name[:-len(".sum.json")] + ".bin") for p in run_dir.glob("step_*.sum.json")]
    for checkpoint in sorted(checkpoints, key=lambda p: step_of(p) or -1, reverse=True):
        run = checksum.run_vouched_by(checkpoint)
        if run is not None:
            return run
    return None


def record_of(entries: list[dict], vouched: str | None = None) -> dict | None:
    """This run's {"identity", "started", "branched", "run"} from its ledger's `entries`: the newest `start` marker
    (its identity, time and run id) and the time of the `branch` marker after it (an audit branch carries its
    parent's start marker, but is another run); None before the run has a start marker. Lines that are no
    entries are skipped (the start reports them, and a `gap` marker that `--accept-ledger-gap` writes lists them):
    they never make this run another one. A ledger whose start markers are all unreadable (a flipped bit broke the
    line: campaign seed 201) while a checkpoint vouches for the run's id (`vouched`) is the record of that id alone:
    the run is still its replica's owner (plan.same_run compares ids), and the replica keeps its intact record."""
    starts = [i for i, e in enumerate(entries) if e.get("event") == "start"]
    if not starts:
        return {"identity": None, "started": None, "branched": None, "run": vouched} if vouched else None
    start = entries[starts[-1]]
    branches = [e for e in entries[starts[-1]:] if e.get("event") == "branch"]
    return {"identity": start.get("identity"), "started": start.get("time"),
            "branched": branches[-1].get("time") if branches else None, "run": start.get("run")}


def earlier_starts(entries: list[dict]) -> list[dict]:
    """The {"run", "started"} of every `start` marker before the newest: this run directory's earlier starts from
    step 0 (each began the run again; its replica may hold the record of one, plan.owner_verdict's "again")."""
    starts = [e for e in entries if e.get("event") == "start"]
    return [{"run": e.get("run"), "started": e.get("time")} for e in starts[:-1]]


def check_at_start(uri: str, run_dir: Path, has_checkpoints: bool) -> str | None:
    """Before a start writes anything in the run directory: refuse (ReplicaError, one line) a plain-path replica on
    the run's own filesystem (`placement_problem`), a replica that holds another run or that another run is
    claiming at this moment, a store that refuses a test write (a read-only key or path), a missing bucket, refused
    credentials, or (first start) an unreachable store; a warning line when a run that has checkpoints finds its
    store unreachable or answering with server errors (training goes on, the replica catches up later). Then claims the replica: with the run's
    record, or provisionally (`claimed_by`) for a run not started yet, so that of two runs started at once on one
    empty prefix the second is refused here."""
    if not rep.is_uri(uri):
        path = Path(uri[len("file://"):] if uri.startswith("file://") else uri).expanduser().resolve()
        problem = placement_problem(str(path), str(run_dir.resolve()), _device(path), _device(run_dir.resolve()))
        if problem is not None:
            raise ReplicaPlacementError(f"replica {uri}: {problem}: a replica must be off the run's disk (another "
                                        "disk or machine, or an object store); nothing was written", "other")
    try:
        replica = rep.Replica(uri, timeout_s=15)
        entries = readable_entries(run_dir / LEDGER_NAME) if run_dir.is_dir() else []
        record, earlier = record_of(entries, vouched_run(run_dir)), earlier_starts(entries)
        me = claimant(run_dir)
        remote = owner.read(replica)
        holder = claim_holder(remote, me, _alive(remote))
        if holder not in ("ours", "stale"):  # a provisional claim of this run directory's, or of a process gone
            owner.check(replica, record, earlier)  # refuses another run (or one starting), or objects that are none
        try:
            replica.probe()
        except rep.ReplicaError as e:
            if e.kind in rep.PASSING:
                raise
            raise rep.ReplicaError(f"{e} (a test write at start): the replica cannot be written; nothing was "
                                   "written", "readonly") from None
        if record is not None and holder in ("ours", "stale"):
            replica.put(owner.OWNER_KEY, owner.record_body(record))
        elif record is not None:
            owner.claim(replica, record, earlier)
        elif holder in ("ours", "stale"):
            replica.put(owner.OWNER_KEY, owner.provisional(me))
        else:
            try:
                replica.put(owner.OWNER_KEY, owner.provisional(me), create=True)
            except FileExistsError:  # another start got there between the read and this write
                owner.check(replica, None)
    except rep.ReplicaError as e:
        if e.kind in rep.PASSING and has_checkpoints:
            return f"{e}; training goes on and the replica catches up when the store is back"
        raise
    return None


def claimant(run_dir: Path) -> dict:
    """Who makes a provisional claim: this host, this process, this run directory."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "run_dir": str(run_dir.resolve())}


def _alive(remote: dict | None) -> bool:
    """Whether the process that made a provisional claim is still running (on this host: `claim_holder` asks only
    then)."""
    claim = (remote or {}).get("claimed_by")
    pid = claim.get("pid") if isinstance(claim, dict) else None
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: running
        pass
    return True


def _device(path: Path) -> int | None:
    """The device of the nearest existing directory at or above `path`."""
    for p in (path, *path.parents):
        try:
            return p.stat().st_dev
        except OSError:
            continue
    return None
