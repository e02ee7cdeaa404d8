"""The ledger's markers: one registry of every `"event"` a `.loss.json` line may carry (name -> when it is written,
its fields, whether it resets the step, whether status shows it, its notice).

Read by the ledger's effective history (rundir/ledger.py `history`: the markers that `resets`), the views
(control/observe/scalars.py), `andrea status`'s incidents (rundir/incidents.py: the markers that are `incident`),
the notices (control/observe/notify.py `from_marker`: the markers with a `notice` message, each a kind of
andrea/notices.py) and docs/formats.md's table of incidents (andrea/docblocks.py writes it from `incidents_table()`).
rundir/ledger.py's docstring shows each one's JSON. A new marker is one `Marker` row here, written with
rundir/ledger.py's `marker(event, step, ...)` where the event happens. Pure data; reads and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from andrea.notices import NOTICE_KINDS

Message = Callable[[dict[str, Any]], str]


@dataclass(frozen=True)
class Marker:
    name: str
    when: str
    """When it is written (docs)."""
    fields: str = ""
    """Its fields besides event, step and time (docs)."""
    resets: bool = False
    """It supersedes every earlier line above its step (the run goes on from there: ledger.history)."""
    incident: bool = False
    """`andrea status` shows the newest one (rundir/incidents.py `last_of_each`)."""
    notice: Message | None = None
    """Its notice's message (the notice kind is the marker's name, andrea/notices.py); None: no notice."""


MARKERS: dict[str, Marker] = {m.name: m for m in (
    Marker("start", "a new run began at step 0", "n_params, seed, identity, mfu's peak", resets=True),
    Marker("resume", "training continues from a checkpoint", "from, mfu's peak", resets=True),
    Marker("eval", "the validation loss", "val_loss, arms"),
    Marker("tasks", "the task audit's accuracies", "acc, acc_norm, acc_norm_chars, examples, tasks, sha256"),
    Marker("pivot", "a new data policy took effect", "phase, caps, floors"),
    Marker("branch", "an audit branch starts here", "parent", resets=True),
    Marker("micro_batch", 'train.micro_batch_size = "auto" chose the rows per pass', "micro_batch_size, rows, "
           "out_of_memory_at"),
    Marker("torn_tail", "a partial last line left by a crash was cut off at open", "bytes"),
    Marker("cut_tail", "a start cut lines no checkpoint vouches for that are no entries", "at, bytes, lines, kept"),
    Marker("incident", "the divergence guard saw the run leave its basin", "reason, loss, grad_norm, attempt",
           incident=True, notice=lambda e: f"guard: incident at step {e['step']}: {e.get('reason')}"),
    Marker("rollback", "the guard went back to its known-good checkpoint and continues from there",
           "from, checkpoint, attempt, remedy, data_offset, lr_scale", resets=True, incident=True,
           notice=lambda e: f"guard: rolled back from step {e.get('from')} to {e.get('checkpoint')}"),
    Marker("recovered", "a checkpoint past the series' incident was confirmed good"),
    Marker("guard_stop", "the divergence persisted after guard.max_attempts rollbacks: the run stopped non-zero",
           "attempts, resume_from", incident=True,
           notice=lambda e: (f"guard: stopped at step {e['step']} after {e.get('attempts')} rollbacks; resume from "
                             f"{e.get('resume_from') or 'the initial state'}")),
    Marker("gap", "the run continued past a ledger its checkpoint did not vouch for (`--accept-ledger-gap`)",
           "reason, recorded_bytes, unreadable_lines", incident=True),
    Marker("stall", "the watchdog found a component busy without progress past its limit; the job exits 75",
           "component, seconds, limit, rank", incident=True),
    Marker("quarantine", "a start found a checkpoint newer than the one it resumes from invalid and moved it, with "
           "its companions, to `quarantine/`", "`step` (resumed from), `file`, `to`, `regions` (the checksum "
           "regions that changed; `[]` for another problem), `reason` (the validation's line)", incident=True,
           notice=lambda e: f"checkpoint {e.get('file')} failed validation, moved to {e.get('to')}: {e.get('reason')}"),
    Marker("resume_below", "a start resumed below the newest checkpoint on disk",
           "`step`, `newest`, `skipped` (the checkpoints set aside), `reason`", incident=True,
           notice=lambda e: (f"resumed from step {e['step']} below the newest checkpoint (step {e.get('newest')}): "
                             f"{e.get('reason')}")),
    Marker("replica_down", "the replica's store started failing (or failed another way); training goes on",
           "`step` (the run's then), `uri`, `problem` (`unreachable`, `denied`, `full`, …), `error`", incident=True,
           notice=lambda e: f"replica {e.get('uri')}: {e.get('error')}; training goes on, the replica lags"),
    Marker("replica_back", "a pass succeeded after the outage: the replica caught up",
           "`step`, `uri`, `down_s`, `replica_step`", incident=True,
           notice=lambda e: (f"replica {e.get('uri')}: reachable again after {e.get('down_s')} s, caught up (holds "
                             f"step {e.get('replica_step')})")),
    Marker("rank_mismatch", "under torchrun, the ranks' digests of the weights they hold differed at a checkpoint "
           "(a silently corrupted GPU); the checkpoint is not written, the guard's `incident` and `rollback` follow",
           "`step`, `ranks` (those outside the majority), `digests` (xxh3-128 of each rank's weights, rank order)",
           incident=True,
           notice=lambda e: (f"ranks {e.get('ranks')} disagree with the others on the weights at step {e['step']}: "
                             "not checkpointed, rolling back to a checkpoint the ranks agreed on")),
    Marker("plateau", "no new best held-out loss in notify.plateau_evals evals (control/observe/plateau.py)",
           "best_step, best_loss, evals",
           notice=lambda e: (f"held-out loss plateau at step {e['step']}: no new best in {e.get('evals')} evals "
                             f"(best {e.get('best_loss')} at step {e.get('best_step')})")),
)}

RESETS = tuple(m.name for m in MARKERS.values() if m.resets)
"""The markers after which the step can go back (a later one supersedes earlier lines above its step)."""
INCIDENTS = tuple(m.name for m in MARKERS.values() if m.incident)
"""The markers `andrea status` shows the newest of, as `incidents`."""


def notice_message(line: dict[str, Any]) -> str | None:
    """The notice a ledger line is, as its message; None for a line that is none (a step entry, junk)."""
    kind = line.get("event")
    m = MARKERS.get(kind) if isinstance(kind, str) else None  # a junk line's event may be unhashable
    return None if m is None or m.notice is None else m.notice(line)


def incidents_table() -> str:
    """docs/formats.md's table of the markers `andrea status` shows (Markdown)."""
    rows = ["| marker | written when | fields | notice |", "|---|---|---|---|"]
    for m in MARKERS.values():
        if m.incident:
            fields = m.fields if "`" in m.fields else ", ".join(f"`{f.strip()}`" for f in m.fields.split(","))
            rows.append(f"| `{m.name}` | {m.when} | {fields} | {'yes' if m.name in NOTICE_KINDS else 'no'} |")
    return "\n".join(rows)
