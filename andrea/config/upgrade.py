"""What an older `run.toml` meant by the defaults it recorded, read under today's schema.

`run.toml` records every key of the configuration a run started with, defaults included (the run's resolved
configuration: andrea/config/load.py). When a later version changes a default, a run started earlier still
holds the old value, and it cannot tell "the default then" from "the operator's choice". For the few defaults
whose old value would now refuse the start or withhold something the operator wants, this module says which
recorded values are the old defaults, so that today's apply. Pure: a dict in, a dict and notes out; reads and
writes nothing. docs/operating.md#upgrading-andrea-under-a-running-run lists the same table for operators.

| key                        | old default (and how it is told apart)                       | read as          |
|----------------------------|--------------------------------------------------------------|------------------|
| checkpoint.replica_wait    | 120.0 in a run.toml without `checkpoint.stop_grace_s`          | today's default  |
|                            | (before the stop's grace period existed)                     |                  |
| notify.events              | exactly the nine kinds before the incident markers           | today's default  |
|                            | (incident … failed, in that order)                           | (every kind)     |
"""

from __future__ import annotations

import copy
from typing import Any

OLD_REPLICA_WAIT = 120.0
OLD_NOTIFY_EVENTS = ["incident", "rollback", "guard_stop", "write_error", "stall", "pivot", "finished", "stopped",
                     "failed"]


def upgrade_run_toml(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`raw` (a run.toml's tables) with the old defaults it recorded removed, so today's defaults apply; and one
    note per key so read. `raw` itself is not changed."""
    out, notes = copy.deepcopy(raw), []
    checkpoint = out.get("checkpoint")
    if (isinstance(checkpoint, dict) and "stop_grace_s" not in checkpoint
            and checkpoint.get("replica_wait") == OLD_REPLICA_WAIT):
        del checkpoint["replica_wait"]
        notes.append(f"checkpoint.replica_wait={OLD_REPLICA_WAIT:g} is the default of the version that started this "
                     "run: today's default applies (it must fit checkpoint.stop_grace_s)")
    notify = out.get("notify")
    if isinstance(notify, dict) and notify.get("events") == OLD_NOTIFY_EVENTS:
        del notify["events"]
        notes.append("notify.events is the default of the version that started this run: today's default applies "
                     "(every kind, the incident markers' included)")
    return out, notes
