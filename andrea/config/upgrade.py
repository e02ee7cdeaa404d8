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
| notify.events              | every kind of a version that recorded the list, not "all":   | today's default  |
|                            | the nine before the incident markers (incident … failed), or | (["all"]: every  |
|                            | the fourteen before "all" (… rank_mismatch), in any order    | kind, new ones)  |
| model.value_embeds, smear, | absent from a run.toml written before they existed: the     | false (the model |
| resid_lambdas, backout     | model trained without them (a modern preset now turns two on) | it trained)      |
| train.value_embed_lr       | absent from a run.toml that records train.embed_lr: the      | half the run's   |
|                            | value embeddings trained at half of it (before their key)    | embed_lr         |

Since "all" (andrea/notices.py), run.toml records the intent: a new notice kind needs no row here. The two lists
below are history, frozen: the defaults of the versions that wrote today's kinds out one by one.
"""

from __future__ import annotations

import copy
from typing import Any

OLD_REPLICA_WAIT = 120.0
OLD_NOTIFY_EVENTS = ["incident", "rollback", "guard_stop", "write_error", "stall", "pivot", "finished", "stopped",
                     "failed"]
LISTED_NOTIFY_EVENTS = [*OLD_NOTIFY_EVENTS, "quarantine", "resume_below", "replica_down", "replica_back",
                        "rank_mismatch"]  # the last default that listed the kinds
OLD_NOTIFY_DEFAULTS = (frozenset(OLD_NOTIFY_EVENTS), frozenset(LISTED_NOTIFY_EVENTS))
MODEL_PARTS = ("value_embeds", "resid_lambdas", "smear", "backout")  # andrea/config/model.py PARAM_EXTRAS, frozen


def meant_every_kind(events: Any) -> bool:
    """Whether a recorded notify.events is a former default: every kind its version knew, in any order."""
    return (isinstance(events, list) and all(isinstance(e, str) for e in events)
            and len(events) == len(set(events)) and frozenset(events) in OLD_NOTIFY_DEFAULTS)


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
    if isinstance(notify, dict) and meant_every_kind(notify.get("events")):
        del notify["events"]
        notes.append("notify.events lists every kind of the version that started this run: read as \"all\" "
                     "(today's default: every kind, those added since included)")
    model = out.get("model")
    # a recorded model (run.toml records every key, arch included) without them: off, which a preset naming them
    # (andrea-12m-modern's) must not turn on
    if isinstance(model, dict) and "arch" in model:
        for key in MODEL_PARTS:
            model.setdefault(key, False)
    train = out.get("train")
    if isinstance(train, dict) and isinstance(train.get("embed_lr"), (int, float)) \
            and not isinstance(train.get("embed_lr"), bool):
        train.setdefault("value_embed_lr", 0.5 * train["embed_lr"])  # exact: a halving
    return out, notes
