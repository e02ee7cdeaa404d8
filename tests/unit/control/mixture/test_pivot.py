"""The policy file's [anneal] table (andrea/control/mixture/pivot.py): a polish pivot's warmdown pending until the
pivot's step is known, then recorded in the configuration; bad tables and a second anneal refused in one line
naming the file. Pure functions over plain data, no run directory."""

from __future__ import annotations

import dataclasses

import pytest

from andrea.config.check import ConfigError
from andrea.config.schema import RunConfig
from andrea.control.mixture.pivot import PENDING, at_step, parse_policy
from andrea.optim.schedule import lr_at

POLICY = {"policy": {"floors": {}}}


def test_an_anneal_table_is_pending_until_the_pivots_step_records_it():
    run = RunConfig()
    pending = parse_policy({**POLICY, "anneal": {"steps": 40}}, run, "p.toml")
    assert (pending.train.anneal_at, pending.train.anneal_steps) == (PENDING, 40)
    done = at_step(pending, 1000)
    assert (done.train.anneal_at, done.train.anneal_steps) == (1000, 40)
    assert dataclasses.replace(done.train, anneal_at=0, anneal_steps=0) == run.train  # nothing else changed
    assert lr_at(999, done.train) == lr_at(999, run.train) and lr_at(1040, done.train) == run.train.min_lr
    assert run.train.anneal_steps == 0  # the run's own configuration untouched


def test_a_pivot_without_an_anneal_keeps_the_runs_own():
    run = at_step(parse_policy({**POLICY, "anneal": {"steps": 40}}, RunConfig(), "p.toml"), 1000)
    later = parse_policy(POLICY, run, "q.toml")
    assert at_step(later, 2000).train == run.train


@pytest.mark.parametrize("raw,phrase", [
    ({**POLICY, "anneal": {"steps": 0}}, "--anneal 0: must be at least 1 step"),
    ({**POLICY, "anneal": {"steps": "40"}}, "[anneal] holds one integer, steps = N"),
    ({**POLICY, "anneal": {"steps": 4, "shape": "linear"}}, "[anneal] holds one integer"),
    ({**POLICY, "schedule": {}}, "holds one [policy] table (and optionally an [anneal] table)"),
    ({"anneal": {"steps": 4}}, "holds one [policy] table"),
])
def test_bad_anneal_tables_are_refused_in_one_line_naming_the_file(raw, phrase):
    with pytest.raises(ConfigError) as e:
        parse_policy(raw, RunConfig(), "p.toml")
    assert str(e.value).startswith("p.toml: ") and phrase in str(e.value) and "\n" not in str(e.value)


def test_a_second_anneal_is_refused():
    run = at_step(parse_policy({**POLICY, "anneal": {"steps": 40}}, RunConfig(), "p.toml"), 1000)
    with pytest.raises(ConfigError, match="q.toml: --anneal 8: the run anneals already from step 1000 over 40"):
        parse_policy({**POLICY, "anneal": {"steps": 8}}, run, "q.toml")
