"""An older run.toml's recorded defaults (andrea/config/upgrade.py): read as today's, and only those."""

from __future__ import annotations

import copy

import pytest

from andrea.config.check import ConfigError
from andrea.config.keepers import NOTIFY_EVENTS
from andrea.config.load import load
from andrea.config.upgrade import LISTED_NOTIFY_EVENTS, OLD_NOTIFY_EVENTS, OLD_REPLICA_WAIT, upgrade_run_toml

REPLICA = "s3://bucket/run"


def older_run_toml() -> dict:
    """What a run started before checkpoint.stop_grace_s and the incident notices recorded."""
    return {"checkpoint": {"every": 100, "replica": REPLICA, "replica_wait": OLD_REPLICA_WAIT},
            "notify": {"events": list(OLD_NOTIFY_EVENTS)}}


def test_an_older_run_with_a_replica_starts_again_under_todays_grace_period():
    with pytest.raises(ConfigError):  # what today's schema says of the value itself
        load(preset="andrea-tiny", overrides=[f"checkpoint.replica={REPLICA}", "checkpoint.replica_wait=120"])
    cfg = load(preset="andrea-tiny", base=older_run_toml())
    assert cfg.checkpoint.replica == REPLICA
    assert cfg.checkpoint.replica_wait <= cfg.checkpoint.stop_grace_s / 2


def test_an_older_runs_default_events_become_every_kind_of_today():
    cfg = load(preset="andrea-tiny", base=older_run_toml())
    assert cfg.notify.events == ["all"] and all(cfg.notify.sends(kind) for kind in NOTIFY_EVENTS)


def test_a_run_toml_listing_every_kind_of_its_day_means_all_and_gets_kinds_added_since(monkeypatch):
    """The last version that listed the kinds wrote these fourteen into every run.toml: in any order they meant
    "all", and a kind added after them (a row of andrea/notices.py) reaches the run without a list here."""
    from andrea import notices
    monkeypatch.setitem(notices.NOTICE_KINDS, "later_kind", notices.Kind("later_kind", "added by a later version"))
    for events in (list(LISTED_NOTIFY_EVENTS), list(reversed(LISTED_NOTIFY_EVENTS))):
        cfg = load(preset="andrea-tiny", base={"notify": {"events": events}})
        assert cfg.notify.events == ["all"] and cfg.notify.sends("later_kind")
    fewer = [e for e in LISTED_NOTIFY_EVENTS if e != "pivot"]  # the operator left one out: their choice
    cfg = load(preset="andrea-tiny", base={"notify": {"events": fewer}})
    assert cfg.notify.events == fewer and not cfg.notify.sends("later_kind") and not cfg.notify.sends("pivot")
    doubled = [*LISTED_NOTIFY_EVENTS, "incident"]
    assert load(preset="andrea-tiny", base={"notify": {"events": doubled}}).notify.events == doubled


def test_an_operators_own_values_are_kept():
    raw = older_run_toml()
    raw["checkpoint"]["stop_grace_s"] = 300.0  # written by a version that knew the grace period: 120 was chosen
    raw["notify"]["events"] = ["incident", "finished"]
    cfg = load(preset="andrea-tiny", base=raw)
    assert cfg.checkpoint.replica_wait == OLD_REPLICA_WAIT
    assert cfg.notify.events == ["incident", "finished"]


def test_the_upgrade_leaves_its_input_alone_and_says_what_it_read_anew():
    raw = older_run_toml()
    before = copy.deepcopy(raw)
    upgraded, notes = upgrade_run_toml(raw)
    assert raw == before
    assert "replica_wait" not in upgraded["checkpoint"] and "events" not in upgraded["notify"]
    assert len(notes) == 2 and any("replica_wait" in n for n in notes) and any("notify.events" in n for n in notes)
    assert upgrade_run_toml(upgraded) == (upgraded, [])


def test_a_run_from_before_the_value_embeddings_key_keeps_training_them_at_half_its_embed_lr():
    """Before train.value_embed_lr, NorMuon ran the value embeddings at half train.embed_lr: a run.toml recording
    embed_lr without the new key resumes at the lr they trained at, not at today's default."""
    assert load(preset="andrea-tiny", base={"train": {"optimizer": "normuon", "embed_lr": 0.2}}).train.value_embed_lr \
        == 0.1
    assert load(preset="andrea-tiny", base={"train": {"embed_lr": 0.2, "value_embed_lr": 0.05}}).train.value_embed_lr \
        == 0.05  # recorded: the operator's
    assert load(preset="andrea-tiny", base={"train": {"lr": 1e-3}}).train.value_embed_lr == 0.15  # no embed_lr
    assert load(preset="andrea-tiny", overrides=["train.embed_lr=0.2"]).train.value_embed_lr == 0.15  # a new run
