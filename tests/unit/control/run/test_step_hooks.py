"""The training step's test hooks, one seam (andrea/control/run/step_hooks.py): none is built in production, and a
poisoned step reads NaN once."""

from __future__ import annotations

import torch

from andrea import testhooks
from andrea.control.run.step_hooks import StepHooks
from andrea.control.run.trainer import StepOutput

HOOKS = ("POISON_STEPS", "FLIP_WEIGHT", "HANG", "STEP_DELAY")


def out(step: int) -> StepOutput:
    return StepOutput(step, 1e-3, torch.tensor(2.0), torch.tensor(1.0), torch.ones(2))


def test_production_builds_no_step_hooks(monkeypatch):
    for name in HOOKS:
        monkeypatch.delenv(testhooks.PREFIX + name, raising=False)
    assert StepHooks.from_env(0) is None
    for name, value in (("POISON_STEPS", "3"), ("FLIP_WEIGHT", "3@1"), ("HANG", "train@9"), ("STEP_DELAY", "0.01")):
        monkeypatch.setenv(testhooks.PREFIX + name, value)
        assert StepHooks.from_env(0) is not None, name
        monkeypatch.delenv(testhooks.PREFIX + name)


def test_a_poisoned_step_reads_nan_once_and_the_others_pass_untouched(monkeypatch):
    for name in HOOKS:
        monkeypatch.delenv(testhooks.PREFIX + name, raising=False)
    monkeypatch.setenv(testhooks.PREFIX + "POISON_STEPS", "3")
    hooks = StepHooks.from_env(0)
    assert hooks.before_push(out(2), None).loss.item() == 2.0
    assert torch.isnan(hooks.before_push(out(3), None).loss)
    assert hooks.before_push(out(3), None).loss.item() == 2.0  # a rollback's replay of step 3 is healthy
