"""The schedules (andrea/optim/schedule.py): cosine unchanged, wsd's warmup, plateau and warmdown (linear, 1 − √) as
pure functions of the step, the decay's progress, and their configuration's refusals. No processes."""

from __future__ import annotations

import math

import pytest

from andrea.config.check import ConfigError
from andrea.config.schema import TrainConfig
from andrea.optim.schedule import decay_progress, lr_at


def wsd(**kw) -> TrainConfig:
    return TrainConfig(lr=1.0, min_lr=0.05, warmup_steps=10, lr_decay_steps=100, schedule="wsd", warmdown_steps=40,
                       **kw)


def test_cosine_is_nanogpts_schedule():
    tc = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, lr_decay_steps=110)
    assert lr_at(0, tc) == pytest.approx(0.1) and lr_at(9, tc) == pytest.approx(1.0)
    assert lr_at(60, tc) == pytest.approx(0.55)  # half way: the cosine's mid point
    assert lr_at(110, tc) == lr_at(500, tc) == 0.1
    assert decay_progress(5, tc) == 0.0 and decay_progress(60, tc) == pytest.approx(0.5)


def test_wsd_holds_the_peak_then_warms_down_linearly_to_min_lr_at_lr_decay_steps():
    tc = wsd()
    assert [lr_at(s, tc) for s in (0, 9)] == [pytest.approx(0.1), pytest.approx(1.0)]
    assert all(lr_at(s, tc) == 1.0 for s in range(10, 61))  # stable until lr_decay_steps - warmdown_steps
    assert lr_at(80, tc) == pytest.approx(0.05 + 0.5 * 0.95)
    assert lr_at(99, tc) > 0.05 and lr_at(100, tc) == lr_at(10_000, tc) == 0.05
    assert decay_progress(60, tc) == 0.0 and decay_progress(80, tc) == pytest.approx(0.5)
    assert decay_progress(100, tc) == 1.0


def test_wsd_one_minus_sqrt_falls_faster_early():
    tc = wsd(warmdown_shape="1-sqrt")
    assert lr_at(70, tc) == pytest.approx(0.05 + (1 - math.sqrt(0.25)) * 0.95)
    assert lr_at(70, tc) < lr_at(70, wsd())


def test_an_anneal_is_the_same_schedule_up_to_where_it_starts():
    """A run without a fixed end (lr_decay_steps far ahead) and its anneal at step 500 (lr_decay_steps = 600,
    warmdown_steps = 100) take the same learning rate at every step before 500."""
    long = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=10, lr_decay_steps=10**9, schedule="wsd",
                       warmdown_steps=100)
    anneal = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=10, lr_decay_steps=600, schedule="wsd",
                         warmdown_steps=100)
    assert all(lr_at(s, long) == lr_at(s, anneal) for s in range(0, 501))
    assert lr_at(550, anneal) == pytest.approx(0.5) and lr_at(600, anneal) == 0.0


@pytest.mark.parametrize("kw,phrase", [
    (dict(schedule="linear"), "train.schedule='linear' must be cosine or wsd"),
    (dict(schedule="wsd", warmdown_shape="cosine"), "train.warmdown_shape='cosine' linear or 1-sqrt"),
    (dict(schedule="wsd"), "train.warmdown_steps=0 must be 1 to train.lr_decay_steps"),
    (dict(schedule="wsd", warmdown_steps=10, lr_decay_steps=5), "train.warmdown_steps=10 must be 1 to"),
])
def test_bad_schedules_are_refused_in_one_line(kw, phrase):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kw)
    assert phrase in str(e.value) and "\n" not in str(e.value)


def test_anneal_moves_a_wsd_runs_warmdown_to_end_n_steps_after_a_plateau_step():
    from andrea.optim.schedule import anneal
    tc = TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=10, lr_decay_steps=10**6, schedule="wsd", warmdown_steps=10**5)
    assert anneal(500, 100, tc) == ["train.lr_decay_steps=600", "train.warmdown_steps=100", "train.steps=600"]
    for step, n, cfg, phrase in [(500, 100, TrainConfig(), "--anneal needs train.schedule"),
                                 (5, 100, tc, "constant only from step 10"),
                                 (950_000, 100, tc, "to 900000"),
                                 (500, 0, tc, "at least 1 step")]:
        with pytest.raises(ValueError, match=phrase):
            anneal(step, n, cfg)


def annealed(tc: TrainConfig, at: int, n: int) -> TrainConfig:
    import dataclasses
    return dataclasses.replace(tc, anneal_at=at, anneal_steps=n)


def test_a_pivots_anneal_keeps_the_schedule_before_it_and_reaches_min_lr_at_its_end():
    """A wsd run on its plateau, annealed from step 50 over 20 steps: the same lr up to 50, then a linear warmdown
    to min_lr at step 70, flat after; its lr_decay_steps (100) no longer matters."""
    tc, at = wsd(), annealed(wsd(), 50, 20)
    assert all(lr_at(s, at) == lr_at(s, tc) for s in range(0, 51))
    assert lr_at(60, at) == pytest.approx(0.05 + 0.5 * 0.95)
    assert all(lr_at(s + 1, at) < lr_at(s, at) for s in range(50, 70))
    assert lr_at(70, at) == lr_at(90, at) == lr_at(10_000, at) == 0.05
    assert decay_progress(50, at) == 0.0 and decay_progress(60, at) == pytest.approx(0.5)
    assert decay_progress(70, at) == 1.0
    sqrt = annealed(wsd(warmdown_shape="1-sqrt"), 50, 20)
    assert lr_at(55, sqrt) == pytest.approx(0.05 + (1 - math.sqrt(0.25)) * 0.95)


def test_annealing_a_cosine_goes_linearly_from_its_lr_at_the_pivot_to_min_lr():
    """A cosine to min_lr 0.1 at step 110, annealed from step 60 (its mid point, lr 0.55) over 10 steps: linear
    from 0.55 to 0.1 by step 70 where the cosine would still be above 0.4; the decay's progress from 0.5 to 1."""
    tc = TrainConfig(lr=1.0, min_lr=0.1, warmup_steps=10, lr_decay_steps=110)
    at = annealed(tc, 60, 10)
    assert all(lr_at(s, at) == lr_at(s, tc) for s in range(0, 61))
    assert lr_at(65, at) == pytest.approx(0.1 + 0.5 * 0.45)
    assert lr_at(70, at) == 0.1 and lr_at(70, tc) > 0.4
    assert decay_progress(60, at) == pytest.approx(0.5) and decay_progress(65, at) == pytest.approx(0.75)
    assert decay_progress(80, at) == 1.0


def test_an_anneal_from_the_middle_of_a_warmdown_starts_from_the_lr_there():
    at = annealed(wsd(), 80, 4)  # the run's own warmdown half done at 80 (lr 0.525)
    assert lr_at(80, at) == lr_at(80, wsd()) and lr_at(82, at) == pytest.approx(0.05 + 0.5 * 0.475)
    assert lr_at(84, at) == 0.05


def test_a_pivots_anneal_is_refused_with_fewer_than_one_step_or_on_a_run_already_annealing():
    from andrea.optim.schedule import anneal, pivot_anneal
    pivot_anneal(5, wsd())
    with pytest.raises(ValueError, match="at least 1 step"):
        pivot_anneal(0, wsd())
    with pytest.raises(ValueError, match="anneals already from step 50 over 20 steps"):
        pivot_anneal(5, annealed(wsd(), 50, 20))
    with pytest.raises(ValueError, match="anneals already from step 30"):  # a branch past a pivot's anneal too
        anneal(40, 5, annealed(TrainConfig(lr=1.0, min_lr=0.0, warmup_steps=10, lr_decay_steps=10**6,
                                           schedule="wsd", warmdown_steps=10**5), 30, 20))
    with pytest.raises(ConfigError, match="train.anneal_at=-1"):
        TrainConfig(anneal_at=-1)
