"""The learning-rate schedules (train.schedule): the lr, and how far its decay has gone, as pure functions of the step.

Reads and writes nothing; a function of (step, TrainConfig) only, so a resumed run takes the same values as one
that never stopped (andrea/control/run/trainer.py). Both schedules warm up linearly from lr/warmup_steps to lr over
the first warmup_steps steps and end at min_lr at `lr_decay_steps`, flat after it:
- cosine (the default, nanoGPT's): a half cosine from lr at the end of the warmup to min_lr at lr_decay_steps.
- wsd (warmup, stable, decay): lr held until lr_decay_steps − warmdown_steps, then a warmdown to min_lr over
  warmdown_steps, linear or 1 − √ (Hägele et al. 2024): a run without a fixed end holds lr_decay_steps far ahead
  and an anneal (a branch that moves lr_decay_steps to step + N, warmdown_steps to N, or a pivot's anneal below)
  finishes a model at any step, where a cosine's shape is fixed by its horizon at the first start.
A pivot's anneal (`andrea pivot --anneal N`, recorded in run.toml as train.anneal_at = S, train.anneal_steps = N)
takes over either schedule from step S: the lr goes from its value at S (the schedule's above) to min_lr over N
steps (wsd: in its warmdown_shape; cosine: linearly, the cosine's horizon no longer mattering), min_lr after S + N.
`decay_progress` is the decay's fraction done, 0 to 1 (0 through the warmup and wsd's stable phase; from its value
at S to 1 over an anneal): what the optimizers' own schedules follow (andrea/optim/normuon.py: Muon's momentum
eased, its weight decay lowered).
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "wsd")
WARMDOWN_SHAPES = ("linear", "1-sqrt")


def decay_start(cfg) -> int:
    """The first step of the decay: the end of the warmup (cosine), or of the stable phase (wsd)."""
    if cfg.schedule == "wsd":
        return max(cfg.warmup_steps, cfg.lr_decay_steps - cfg.warmdown_steps)
    return cfg.warmup_steps


def annealing(step: int, cfg) -> bool:
    """Whether a pivot's anneal (train.anneal_at, train.anneal_steps) sets the schedule at `step`."""
    return cfg.anneal_steps > 0 and step >= cfg.anneal_at


def anneal_fraction(step: int, cfg) -> float:
    """How far a pivot's anneal has gone at `step`: 0 at anneal_at, 1 from anneal_at + anneal_steps on."""
    return min(1.0, (step - cfg.anneal_at) / cfg.anneal_steps)


def decay_progress(step: int, cfg) -> float:
    """How far the decay has gone at `step`: 0 before it starts, 1 from lr_decay_steps (or an anneal's end) on."""
    if annealing(step, cfg):
        p0 = _decay_progress(cfg.anneal_at, cfg)
        return p0 + (1.0 - p0) * anneal_fraction(step, cfg)
    return _decay_progress(step, cfg)


def _decay_progress(step: int, cfg) -> float:
    start = decay_start(cfg)
    if step < start:
        return 0.0
    return min(1.0, (step - start) / max(1, cfg.lr_decay_steps - start))


def lr_at(step: int, cfg) -> float:
    """train.lr's schedule at `step` (the module docstring); the guard's lr scale multiplies it elsewhere."""
    if annealing(step, cfg):
        p, top = anneal_fraction(step, cfg), _lr_at(cfg.anneal_at, cfg)
        left = 1.0 - math.sqrt(p) if cfg.schedule == "wsd" and cfg.warmdown_shape == "1-sqrt" else 1.0 - p
        return cfg.min_lr + left * (top - cfg.min_lr)
    return _lr_at(step, cfg)


def _lr_at(step: int, cfg) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.lr_decay_steps:
        return cfg.min_lr
    if cfg.schedule == "wsd":
        p = _decay_progress(step, cfg)
        left = 1.0 - p if cfg.warmdown_shape == "linear" else 1.0 - math.sqrt(p)
        return cfg.min_lr + left * (cfg.lr - cfg.min_lr)
    progress = (step - cfg.warmup_steps) / max(1, cfg.lr_decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def anneal(step: int, n: int, cfg) -> list[str]:
    """The `--set` overrides that anneal a wsd run from `step` over `n` steps (`andrea branch --anneal N`): its
    warmdown moved to end at step + n, the run stopping there. The same lr as the run's up to `step`, refused (a
    ValueError, one line) unless the run is wsd and still on its plateau at `step` (a cosine's shape, or a warmdown
    already under way, would make the lr jump)."""
    if cfg.schedule != "wsd":
        raise ValueError(f"--anneal needs train.schedule = \"wsd\"; this run's is {cfg.schedule!r} (its lr at each step "
                         f"is fixed by its horizon)")
    if n < 1:
        raise ValueError(f"--anneal {n}: must be at least 1 step")
    if cfg.anneal_steps > 0 and step > cfg.anneal_at:
        raise ValueError(f"--anneal from step {step}: the run anneals already from step {cfg.anneal_at} (a pivot's "
                         f"anneal over {cfg.anneal_steps} steps)")
    if step < cfg.warmup_steps or step > decay_start(cfg):
        raise ValueError(f"--anneal from step {step}: the run's lr is constant only from step {cfg.warmup_steps} to "
                         f"{decay_start(cfg)} (its warmup ends at the first, its own warmdown starts at the second)")
    return [f"train.lr_decay_steps={step + n}", f"train.warmdown_steps={n}", f"train.steps={step + n}"]


def pivot_anneal(n: int, cfg) -> None:
    """Refuse (a ValueError, one line) a pivot's anneal over `n` steps that the run `cfg` cannot take: fewer than
    1 step, or a run already annealing (a second anneal would restart from the first's top: the lr would jump)."""
    if n < 1:
        raise ValueError(f"--anneal {n}: must be at least 1 step")
    if cfg.anneal_steps > 0:
        raise ValueError(f"--anneal {n}: the run anneals already from step {cfg.anneal_at} over {cfg.anneal_steps} "
                         f"steps (train.anneal_at, train.anneal_steps in run.toml)")
