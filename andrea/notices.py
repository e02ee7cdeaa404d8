"""The notice kinds: one registry of what an operator can be told (name -> meaning, detail, how it is limited).

Every other place that speaks of notice kinds reads this table: the check of `notify.events` and its error
(andrea/config/keepers.py), the sender's rate limit (control/observe/notify.py), the notices of ledger markers
(rundir/markers.py says which marker is which notice, with its message) and docs/operating.md's table of notices
(andrea/docblocks.py writes it from `table()`). A new kind is one `Kind` row here and one
`Notifier.send(kind, step, message=..., **detail)` where it happens (or a marker with a message in
rundir/markers.py); a run whose `notify.events` is "all" (the default) gets it after an upgrade.
Pure data; reads and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

ALL = "all"
"""`notify.events = ["all"]`: every kind this version knows, and those a later version adds."""


@dataclass(frozen=True)
class Kind:
    """One notice kind: its `name` (the JSON's "event"), its `meaning` (what happened, for docs/operating.md's table),
    its `detail` (the JSON's fields besides event, step, time, run_dir, host, pid, rank and message); a `last_word`
    is a process's last notice, never rate-limited (notify.max_per_hour); one of `any_rank` is sent by whichever
    rank meets it (the hung rank's stall), every other kind by rank 0 only."""

    name: str
    meaning: str
    detail: str = ""
    last_word: bool = False
    any_rank: bool = False


NOTICE_KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("incident", "the divergence guard saw the run leave its basin", "the ledger's incident marker"),
    Kind("rollback", "the guard went back to its known-good checkpoint", "the ledger's rollback marker"),
    Kind("guard_stop", "the guard gave up after guard.max_attempts rollbacks; the run exits 1",
         "the ledger's guard_stop marker"),
    Kind("write_error", "a checkpoint could not be written", "error; disk_full: true on ENOSPC"),
    Kind("stall", "the watchdog found a hung component; the process exits 75", "component, seconds, limit",
         last_word=True, any_rank=True),
    Kind("pivot", "a hot pivot took effect", "phase, caps, floors"),
    Kind("finished", "the run reached its step target", last_word=True),
    Kind("stopped", "a signal stopped the run cleanly", last_word=True),
    Kind("failed", "the run stopped with an error", "error", last_word=True),
    Kind("quarantine", "a start moved a checkpoint that failed validation to quarantine/",
         "the ledger's quarantine marker: file, to, regions, reason"),
    Kind("resume_below", "a start resumed below the newest checkpoint on disk", "newest, skipped, reason"),
    Kind("replica_down", "the replica's store started failing; training goes on", "uri, problem, error"),
    Kind("replica_back", "the replica's store is back and the replica caught up", "uri, down_s, replica_step"),
    Kind("rank_mismatch", "under torchrun the ranks' weights differed at a checkpoint; the incident and rollback "
         "notices follow", "ranks, digests"),
    Kind("plateau", "no new best held-out loss in notify.plateau_evals evals (again after as many more)",
         "the ledger's plateau marker: best_step, best_loss, evals"),
)}


def unknown(events: list[str]) -> list[str]:
    """The entries of a `notify.events` list that name no kind (and are not "all")."""
    return [e for e in events if e != ALL and e not in NOTICE_KINDS]


def wanted(events: list[str], kind: str) -> bool:
    """Whether a run whose `notify.events` is `events` is sent notices of `kind`."""
    return ALL in events or kind in events


def known() -> str:
    """The accepted names, for an error line."""
    return ", ".join([ALL, *NOTICE_KINDS])


def table() -> str:
    """docs/operating.md's table of notice kinds (Markdown)."""
    rows = ["| kind | sent when | detail |", "|---|---|---|"]
    for k in NOTICE_KINDS.values():
        when = k.meaning + (" (a process's last word: never rate-limited)" if k.last_word else "")
        rows.append(f"| `{k.name}` | {when} | {k.detail or '-'} |")
    return "\n".join(rows)
