"""The training step's test hooks, one seam: what `TrainingRun._step` (control/run/runtime.py) calls around each
update when a test set one of their variables, and nothing at all in production (`from_env` is then None).

Each variable is read and documented in andrea/testhooks.py; here is only what they do to a step:
    ANDREA_TEST_POISON_STEPS   the record of a chosen header step reads loss = NaN, once per process (a divergence
                               the guard meets as a non-finite incident; the weights are untouched)
    ANDREA_TEST_FLIP_WEIGHT    one weight bit flipped on one rank after a chosen step, once per process
                               (control/parallel/agreement.py must catch it)
    ANDREA_TEST_HANG=train@s   the training thread hangs for good after step s (control/observe/watchdog.py)
    ANDREA_TEST_STEP_DELAY     a sleep after each step (a window for signals)
`before_push` changes the step's record before the boundary sees it, `after_push` runs once it is pushed.
Runs on the training thread. Reads the environment (through andrea/testhooks.py) once per process.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from andrea import testhooks
from andrea.control.observe import watchdog
from andrea.control.parallel import agreement


class StepHooks:
    def __init__(self, rank: int):
        self.rank = rank
        self.poison = testhooks.poison_steps()  # andrea/testhooks.py: ANDREA_TEST_POISON_STEPS
        self.flip = testhooks.flip_weight()  # andrea/testhooks.py: ANDREA_TEST_FLIP_WEIGHT, (step, rank) or None
        self.delay = testhooks.step_delay()  # andrea/testhooks.py: ANDREA_TEST_STEP_DELAY
        self.hang = bool(testhooks.hang())  # andrea/testhooks.py: ANDREA_TEST_HANG (its step: watchdog.test_hang)

    @classmethod
    def from_env(cls, rank: int) -> StepHooks | None:
        """The hooks a test set, or None when it set none (production: the step calls nothing)."""
        hooks = cls(rank)
        return hooks if hooks.poison or hooks.flip is not None or hooks.delay or hooks.hang else None

    def before_push(self, out, trainer):
        """The step's record as the boundary will see it (the poison), after the weights' own hook (the flip)."""
        if out.step in self.poison:  # once per process: a rollback's replay of the step stays healthy
            self.poison.discard(out.step)
            out = dataclasses.replace(out, loss=torch.full_like(out.loss, float("nan")))
        if self.flip is not None and self.flip == (out.step, self.rank):  # once per process
            self.flip = None
            agreement.flip_one_bit(trainer.weights())
        return out

    def after_push(self, out) -> None:
        watchdog.test_hang("train", out.step, self.rank)
        if self.delay:
            time.sleep(self.delay)
