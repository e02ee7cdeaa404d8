"""Incidents besides the divergence guard's, as ledger markers, and `andrea status`'s last incident of each kind.

Every incident an operator of a long run must be able to reconstruct afterwards is a marker in `.loss.json`
(rundir/ledger.py `marker`; registered in rundir/markers.py) and, from it, a notice (control/observe/notify.py
`from_marker`); the markers reach the replica with the ledger, and so does `quarantine/` (control/replica/remote.py).
Built here (plain functions over plain data), appended by their owners:

    {"event": "quarantine", "step": S, "file": "step_000030.bin", "to": "quarantine/", "regions": ["weights"],
     "reason": "step_000030.bin: checksum mismatch in weights: ..."}
        a checkpoint newer than the one resumed from failed validation and was moved to quarantine/ with its
        companions (control/run/resume.py); S is the step the run resumes from; `regions`: the checksum regions that
        changed ([] for another problem: truncated, non-finite, a missing companion ...)
    {"event": "resume_below", "step": S, "newest": N, "skipped": ["step_000030.bin", ...], "reason": "..."}
        the start resumed from S although checkpoints up to N were on disk: why, in the first skipped one's words
    {"event": "replica_down", "step": S, "uri": "s3://b/run", "problem": "unreachable", "error": "..."}
        the replica's store started failing (or failed another way): training goes on, the replica lags
    {"event": "replica_back", "step": S, "uri": "s3://b/run", "down_s": 9.2, "replica_step": R}
        the store is back and a pass caught up: the replica holds step R again
    {"event": "rank_mismatch", "step": S, "ranks": [1], "digests": ["<xxh3-128 hex>", ...]}
        under torchrun the ranks' weights differed at the checkpoint of S (control/parallel/agreement.py, written by
        control/run/boundary.py): `ranks` outside the majority, every rank's digest in rank order; the guard's incident and
        rollback follow, and the checkpoint of S is never written
S is the run's header step when the marker is written. `last_of_each` is what `andrea status` shows as
`incidents`: the newest marker of every kind in KINDS (null for a kind the run never met).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from andrea.rundir.ledger import marker
from andrea.rundir.markers import INCIDENTS as KINDS  # the markers whose `incident` is set (rundir/markers.py)


def regions_named(reason: str) -> list[str]:
    """The checksum regions a validation failure names ("checksum mismatch in weights, m: ..."), else []."""
    m = re.search(r"checksum mismatch in ([a-z, ]+):", reason)
    return [r.strip() for r in m.group(1).split(",")] if m else []


def resume_markers(step: int, skipped: list[str], moved: list[str], quarantine_dir: str) -> list[dict[str, Any]]:
    """The markers of a start that resumed from `step` below newer checkpoints: one `quarantine` per checkpoint
    moved away (`moved`: names), with the validation failure said of it (`skipped`: "PATH: reason" lines, newest
    first), then one `resume_below`. [] when the start resumed from the newest checkpoint."""
    if not moved:
        return []
    said = {}
    for line in skipped:
        path, _, reason = line.partition(": ")
        said.setdefault(Path(path).name, f"{Path(path).name}: {reason}" if reason else line)
    lines = []
    for name in moved:
        reason = said.get(name, f"{name}: failed validation")
        lines.append(marker("quarantine", step, file=name, to=f"{quarantine_dir}/", regions=regions_named(reason),
                            reason=reason))
    newest = max(moved)
    lines.append(marker("resume_below", step, newest=int(newest[len("step_"):-len(".bin")]), skipped=sorted(moved),
                        reason=said.get(newest, f"{newest}: failed validation")))
    return lines


def last_of_each(entries: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """The newest marker of each incident kind in the ledger (superseded or not: an incident happened)."""
    last: dict[str, dict[str, Any] | None] = dict.fromkeys(KINDS)
    for e in entries:
        if e.get("event") in last:
            last[e["event"]] = e
    return last
