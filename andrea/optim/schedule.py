"""The learning-rate schedules (train.schedule): the lr, and how far its decay has gone, as pure functions of the step.

Reads and writes nothing; a function of (step, TrainConfig) only, so a resumed run takes the same values as one
that never stopped (andrea/control/run/trainer.py). Both schedules warm up linearly from lr/warmup_steps to lr over
the first warmup_steps steps and end at min_lr at `lr_decay_steps`, flat after it:
- cosine (the default, nanoGPT's): a half cosine from lr at the end of the warmup to min_lr at lr_decay_steps.
- wsd (warmup, stable, decay): lr held until lr_decay_steps − warmdown_steps, then a warmdown to min_lr over
  warmdown_steps, linear or 1 − √ (Hägele et al. 2024): a run without a fixed end holds lr_decay_steps far ahead
  and an anneal (a branch or a pivot that moves lr_decay_steps to step + N, warmdown_steps to N) finishes a model
  at any step, where a cosine's shape is fixed by its horizon at the first start.
`decay_progress` is the decay's fraction done, 0 to 1 (0 through the warmup and wsd's stable phase): what the
optimizers' own schedules follow (andrea/optim/normuon.py: Muon's momentum eased, its weight decay lowered).
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


def decay_progress(step: int, cfg) -> float:
    """How far the decay has gone at `step`: 0 before it starts, 1 from lr_decay_steps on."""
    start = decay_start(cfg)
    if step < start:
        return 0.0
    return min(1.0, (step - start) / max(1, cfg.lr_decay_steps - start))


def lr_at(step: int, cfg) -> float:
    """train.lr's schedule at `step` (the module docstring); the guard's lr scale multiplies it elsewhere."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if step >= cfg.lr_decay_steps:
        return cfg.min_lr
    if cfg.schedule == "wsd":
        p = decay_progress(step, cfg)
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
    if step < cfg.warmup_steps or step > decay_start(cfg):
        raise ValueError(f"--anneal from step {step}: the run's lr is constant only from step {cfg.warmup_steps} to "
                         f"{decay_start(cfg)} (its warmup ends at the first, its own warmdown starts at the second)")
    return [f"train.lr_decay_steps={step + n}", f"train.warmdown_steps={n}", f"train.steps={step + n}"]
