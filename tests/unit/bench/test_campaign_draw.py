"""bench/campaign_draw.py: the seeded campaign's drawing, shrinking and table, over plain data (no process or file).

A seed must replay alone: the drawing is a pure function of it, every kind of event is reachable, and the
constraints hold (a replica's events only with a replica, steps inside the run). The shrinking finds the
smallest failing sub-sequence; the perfect run's key leaves out exactly what docs/ say does not change the bytes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from bench import campaign_draw as cd
from bench.campaign_draw import Event, Outcome


def test_a_seed_draws_the_same_campaign_every_time_and_another_seed_another():
    assert cd.draw(17) == cd.draw(17)
    assert cd.draw(17).describe() == cd.draw(17).describe()
    assert len({(cd.draw(s).config, cd.draw(s).describe()) for s in range(50)}) == 50


def test_the_drawing_reaches_every_kind_and_every_configuration_axis():
    draws = [cd.draw(s) for s in range(300)]
    kinds = Counter(e.kind for d in draws for e in d.events)
    assert set(kinds) == set(cd.KINDS), set(cd.KINDS) - set(kinds)
    configs = [d.config for d in draws]
    for axis, values in {"arch": {"gpt2", "modern"}, "optimizer": {"adamw", "muon", "normuon"},
                         "guard": {True, False}, "replica": {True, False}, "ranks": {1, 2}, "micro": {0, 2, 4},
                         "parts": {True, False}, "wsd": {True, False}}.items():
        assert {getattr(c, axis) for c in configs} == values, axis
    assert all(1 <= len(d.events) <= 3 for d in draws)


def test_the_recipes_choices_leave_every_earlier_draw_and_reach_normuon_the_parts_and_wsd():
    """The 2026 recipe's dimension is drawn after the events: a seed keeps the configuration (but its Muon maybe
    become NorMuon) and the events it drew before the dimension existed, so the replays of seeds found then hold
    with recipe=False; the choices reach what the modern presets run, only where they apply."""
    draws = [(cd.draw(s), cd.draw(s, recipe=False)) for s in range(300)]
    plain_fields = {"optimizer", "parts", "wsd"}
    for new, old in draws:
        assert new.events == old.events
        assert {k: v for k, v in vars(new.config).items() if k not in plain_fields} == \
            {k: v for k, v in vars(old.config).items() if k not in plain_fields}
        assert (old.config.optimizer, old.config.parts, old.config.wsd) in {("adamw", False, False),
                                                                            ("muon", False, False)}
        c = new.config
        assert c.optimizer == old.config.optimizer or (old.config.optimizer, c.optimizer) == ("muon", "normuon")
        assert not c.parts or c.arch == "modern"
    configs = [new.config for new, _ in draws]
    assert {c.optimizer for c in configs} == {"adamw", "muon", "normuon"}
    assert any(c.parts and c.optimizer == "normuon" for c in configs) and any(c.parts and c.wsd for c in configs)
    wsd = next(c for c in configs if c.wsd).sets()
    assert 'train.schedule="wsd"' in wsd and "model.value_embeds=true" not in cd.draw(0, recipe=False).config.sets()


def test_events_are_ordered_by_step_inside_the_run_and_need_what_they_strike():
    for s in range(300):
        d = cd.draw(s)
        ats = [e.at for e in d.events]
        assert ats == sorted(ats)
        assert all(1 <= a < d.config.steps for a in ats)
        assert all(e.at >= 2 for e in d.events if e.kind == "poison")
        if not d.config.replica:
            assert not [e for e in d.events if e.kind in cd.NEEDS_REPLICA], s
        for e in d.events:
            if e.kind in ("flip", "cut"):
                assert e.arg("file") in cd.FILES and 0 <= e.arg("u") < 1


def test_pick_names_the_newest_for_half_of_the_draws_and_reaches_the_oldest():
    steps = [4, 8, 12, 16]
    assert cd.pick(0.0, steps) == cd.pick(0.49, steps) == 16
    assert cd.pick(0.999, steps) == 4
    assert {cd.pick(u / 100, steps) for u in range(100)} == set(steps)
    assert cd.pick(0.3, []) is None


def test_ddmin_finds_the_two_events_that_fail_together_in_order():
    events = tuple(range(8))
    smallest, trials = cd.ddmin(events, lambda t: 3 in t and 6 in t, budget=100)
    assert smallest == (3, 6) and trials <= 40


def test_ddmin_says_when_the_configuration_alone_fails_and_keeps_to_its_budget():
    assert cd.ddmin((1, 2, 3), lambda t: True, budget=5) == ((), 1)
    calls = []
    smallest, trials = cd.ddmin(tuple(range(8)), lambda t: calls.append(t) or (3 in t and 6 in t), budget=3)
    assert trials == 3 == len(calls) and 3 in smallest and 6 in smallest


def test_the_perfect_run_is_shared_across_retention_and_replica_but_not_across_what_changes_the_bytes():
    d = cd.draw(5)
    cfg = d.config
    other = replace(cfg, keep_last=cfg.keep_last + 1, keep_every=7, replica=not cfg.replica)
    assert cd.perfect_key(cfg, (), ()) == cd.perfect_key(other, (), ())
    assert cd.perfect_key(cfg, (), ()) != cd.perfect_key(replace(cfg, optimizer="x"), (), ())
    assert cd.perfect_key(cfg, (), ()) != cd.perfect_key(cfg, (), (12,))
    pivot = Event("pivot", 10, (("policy", {"caps": {"stdlib-code": 0.5}}),))
    assert cd.perfect_key(cfg, (pivot,), ()) != cd.perfect_key(cfg, (), ())
    assert cd.perfect_key(cfg, (pivot, Event("sigkill", 3)), ()) == cd.perfect_key(cfg, (pivot,), ())
    assert cd.perfect_key(cfg, (Event("stop", 7),), ()) != cd.perfect_key(cfg, (), ())


def test_the_perfect_run_does_the_commands_and_stops_where_an_offline_event_stopped_the_run():
    """A poisoned step a start met and a pivot are commands; every other offline event's `train --steps at` is a
    stop the perfect run makes too (a step target resolves a held-back checkpoint as an incident there); the
    online faults, and a poison no start met, are not."""
    pivot = Event("pivot", 10, (("policy", {"caps": {"stdlib-code": 0.5}}),))
    events = (Event("sigkill", 3), Event("poison", 5), Event("flip", 8, (("file", "bin"),)), pivot,
              Event("poison", 12), Event("init_from", 20), Event("disk", 22), Event("restore", 25))
    assert cd.perfect_commands(events, (5,)) == (Event("poison", 5), Event("stop", 8), pivot, Event("stop", 20),
                                                 Event("stop", 25))


@pytest.mark.parametrize("text,seeds", [("0-3", [0, 1, 2, 3]), ("17", [17]), ("3,5,10-12", [3, 5, 10, 11, 12])])
def test_seed_ranges(text, seeds):
    assert cd.parse_seeds(text) == seeds


def test_the_table_counts_events_and_lists_each_failure_with_its_replay():
    outcomes = [Outcome(1, [], ["sigkill", "flip"], ["disk: no tmpfs"]),
                Outcome(2, ["DIFFERENT BYTES: x"], ["sigkill"], [], shrunk="sigkill@3", replay="python r --seed 2")]
    drawn = Counter({"sigkill": 2, "flip": 1, "disk": 1})
    text = "\n".join(cd.summary(outcomes, 100.0, drawn))
    assert "2 sequences, 1 failing" in text
    assert "| sigkill | 2 | 2 | 0 |" in text and "| disk | 1 | 0 | 1 |" in text
    assert "| 2 | DIFFERENT BYTES: x | sigkill@3 | `python r --seed 2` |" in text
