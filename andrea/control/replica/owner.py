"""Who a replica belongs to: its `replica.json`, read, checked against this run, and claimed.

    replica.json   {"format": 1, "identity": {...}, "started": T, "branched": B, "run": ID}: the run this replica
                   belongs to (the `identity`, `time` and `run` id of the ledger's newest `start` marker, and the time
                   of the `branch` marker after it, null for a run that is no branch; a record written before run ids
                   has no `run`, and is read as before); written first, with create-if-absent, and checked before
                   anything else is written; before a new run has a record, a provisional claim
                   {"format": 1, "claimed_by": {"host", "pid", "run_dir"}} (control/replica/admit.py), replaced by the
                   record at the run's first pass

A start from step 0 writes a new `start` marker (a new time, a new run id) in the same ledger: a first start that
ended before its first checkpoint and begins again is the same run, and claims the replica its earlier start
recorded when that one published no checkpoint (`plan.owner_verdict`: "again"); a replica that holds another run,
or this directory's earlier start under another identity, or any run with published checkpoints, is refused in one
line. The decisions are control/replica/plan.py's; this module does the reads and writes (control/replica/remote.py's
store).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence

from andrea.control.replica import remote as rep
from andrea.control.replica.plan import owner_verdict, started_here

log = logging.getLogger("andrea.control.replica")
OWNER_KEY = "replica.json"
FORMAT = 1


def read(replica: rep.Replica) -> dict | None:
    """The replica's owner record (or provisional claim); None when it has none."""
    data = replica.get(OWNER_KEY)
    if data is None:
        return None
    try:
        return json.loads(data)
    except ValueError:
        raise rep.ReplicaError(f"replica {replica.uri}: {OWNER_KEY} is not JSON: not an andrea replica",
                               "owner") from None


def check(replica: rep.Replica, local: dict | None, earlier: Sequence[dict] = ()) -> str:
    """Refuse (ReplicaError "owner", one line) a replica that holds another run, that another run is starting on,
    or that holds objects but no owner record. `local`: this run's record (None: a run that has not started);
    `earlier`: its earlier start markers (admit.py's `earlier_starts`). Returns `plan.owner_verdict`'s "none",
    "ours" or "again" (this run directory's earlier start, which this start may claim)."""
    remote = read(replica)
    if remote is None:
        if any(not k.startswith(rep.PROBE_PREFIX) for k in replica.listing()):
            raise rep.ReplicaError(f"replica {replica.uri}: holds objects but no {OWNER_KEY}: not an andrea replica; "
                                   "choose an empty prefix", "owner")
        return "none"
    if remote.get("started") is None and isinstance(remote.get("claimed_by"), dict):
        raise rep.ReplicaError(f"replica {replica.uri}: another run is starting on it ({_short(remote['claimed_by'])})"
                               ": choose another prefix", "owner")
    ours = owner_verdict(remote, local, earlier, ())
    if ours == "ours":
        return ours
    published = rep.published_steps(replica.listing())  # listed only when the record is not this run's
    verdict = owner_verdict(remote, local, earlier, published)
    if verdict == "again":
        return verdict
    holds = f"another run (started at {remote.get('started')}, {_short(remote.get('identity'))})"
    if published:
        raise rep.ReplicaError(f"replica {replica.uri}: already holds {holds}, checkpoints up to step "
                               f"{published[-1]}: choose another prefix, or `andrea restore` that run", "owner")
    if started_here(remote, earlier):
        holds = (f"this run directory's earlier start (at {remote.get('started')}) under another identity "
                 f"({_short(remote.get('identity'))})")
    raise rep.ReplicaError(f"replica {replica.uri}: already holds {holds}, with no published checkpoint: choose "
                           "another prefix, or delete its objects to use it", "owner")


def claim(replica: rep.Replica, local: dict, earlier: Sequence[dict] = (), claimant: dict | None = None) -> None:
    """Record this run as the replica's owner (create-if-absent), or check the record already there: a provisional
    claim by `claimant` (this process: check_at_start's), or the record of this run directory's earlier start that
    published no checkpoint (`check`: "again"), is replaced by this run's record; another run's is refused."""
    body = record_body(local)
    try:
        replica.put(OWNER_KEY, body, create=True)
    except FileExistsError:  # there already (this run's, or another writer got there first): check it
        remote = read(replica) or {}
        if claimant is not None and remote.get("started") is None and remote.get("claimed_by") == claimant:
            replica.put(OWNER_KEY, body)
        elif check(replica, local, earlier) == "again":
            log.info("replica %s: held this run directory's earlier start (at %s), which published no checkpoint: "
                     "claimed for its start at %s", replica.uri, remote.get("started"), local.get("started"))
            replica.put(OWNER_KEY, body)
    check(replica, local, earlier)


def provisional(claimant: dict) -> bytes:
    """A provisional claim's body (control/replica/admit.py)."""
    return json.dumps({"format": FORMAT, "claimed_by": claimant}).encode()


def record_body(local: dict) -> bytes:
    """An owner record's body."""
    return json.dumps({"format": FORMAT, **local}, indent=1).encode()


def _short(identity) -> str:
    if not isinstance(identity, dict):
        return "no identity"
    return ", ".join(f"{k}={v}" for k, v in identity.items() if k != "tokenizer.sha256")
