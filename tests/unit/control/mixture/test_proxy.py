"""Tests for andrea/control/mixture/proxy.py with `policy.target`: the state it saves names the objective and its value,
and a `.state.json` of the old bandit format starts a new phase at the resume step, as a pivot does. Pure CPU:
fake token arrays, fake per-sequence losses, no trainer."""

from __future__ import annotations

import json

import numpy as np

from andrea.config.load import load
from andrea.control.mixture.proxy import DataProxy
from andrea.data.store import ArmTokens

STEPS = 40


def setup(target: dict | None = None):
    overrides = ["train.batch_size=8", "model.block_size=16"]
    if target:
        overrides.append("policy.target={" + ", ".join(f'"{a}" = {w}' for a, w in target.items()) + "}")
    cfg = load(overrides=overrides)
    rng = np.random.default_rng(0)
    arms = [ArmTokens(n, rng.integers(0, 300, 4000).astype(np.uint16), rng.integers(0, 300, 400).astype(np.uint16))
            for n in cfg.data.arm_names()]
    return cfg, arms


def drive(proxy: DataProxy, steps: int) -> None:
    for step in range(steps):
        batch = proxy.batch(step)
        proxy.observe(step + 1, 3.0 - 0.01 * step + 0.1 * batch.arm_ids.astype(np.float64))


def test_state_names_the_target_and_its_value():
    cfg, arms = setup({"pydoc-topics": 0.0})
    proxy = DataProxy(cfg, arms)
    drive(proxy, STEPS)
    state = json.loads(json.dumps(proxy.state(STEPS)))
    assert state["policy"]["target"] == {"stdlib-docstrings": 0.5, "stdlib-code": 0.5, "pydoc-topics": 0.0}
    assert isinstance(state["target_loss"], float) and state["target_loss"] == state["bandit"]["target_loss"]
    assert state["shares"]["pydoc-topics"] < 1 / 3


def test_an_old_format_state_starts_a_new_phase_like_a_pivot():
    cfg, arms = setup()
    proxy = DataProxy(cfg, arms)
    drive(proxy, STEPS)
    state = json.loads(json.dumps(proxy.state(STEPS)))
    same, warnings = DataProxy.from_state(cfg, arms, state, STEPS, ".state.json")
    assert warnings == [] and same.phase == 0 and same.state(STEPS) == state  # the current format resumes
    state["bandit"]["format"] = 1
    reset, warnings = DataProxy.from_state(cfg, arms, state, STEPS, ".state.json")
    assert len(warnings) == 1 and "format 1" in warnings[0]
    assert (reset.phase, reset.phase_start, reset.applied_upto) == (1, STEPS, STEPS)
    fresh = DataProxy(cfg, arms, phase=1, phase_start=STEPS)
    assert np.array_equal(reset.batch(STEPS).arm_ids, fresh.batch(STEPS).arm_ids)
