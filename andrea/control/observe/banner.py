"""The start banner: what is about to run, said in a few log lines before the first step.

The model (its preset when the model section is a shipped preset's, the arch, the parameters), the batch in
tokens per step, the optimizer and its schedule, the cadences (log, checkpoint, retention), where checkpoints and
the replica go, and the target step (when it will be reached is said by the progress once steps are timed:
control/observe/progress.py). `lines` is a pure function over the configuration and the start's facts;
`preset_of` reads the shipped presets. Writes nothing; the run logs the lines (control/run/runtime.py).
"""

from __future__ import annotations

from pathlib import Path

from andrea.config import load as configload
from andrea.config.check import ConfigError
from andrea.config.schema import ModelConfig, RunConfig


def preset_of(model: ModelConfig) -> str | None:
    """The shipped preset whose [model] section this is (the first by name), else None."""
    for name in configload.preset_names():
        try:
            if configload.load(preset=name).model == model:
                return name
        except ConfigError:  # a preset this version cannot read is no match
            continue
    return None


def lines(cfg: RunConfig, *, preset: str | None, n_params: int, step: int, stop_at: int, device: str,
          kernels: str, run_dir: Path, world_size: int = 1) -> list[str]:
    """The banner's lines, in the order an operator asks: what, how fast it learns, how often it saves, where, until when."""
    m, tc, ck = cfg.model, cfg.train, cfg.checkpoint
    tokens = tc.batch_size * m.block_size
    what = (preset if m.arch in preset else f"{preset} ({m.arch})") if preset else f"a custom {m.arch} model"
    ranks = f" on {world_size} ranks" if world_size > 1 else ""
    schedule = getattr(tc, "schedule", "cosine")  # the LR schedule's shape where the schema names one
    opt = (f"muon lr {tc.muon_lr:g} + adamw" if tc.optimizer == "muon" else tc.optimizer)  # Muon: hidden matrices
    replica = ck.replica or "none"
    begin = "from scratch" if step == 0 else f"from step {step:,}"
    left = max(stop_at - step, 0)
    return [
        f"model: {what}, {n_params:,} params ({m.n_layer} layers, d {m.n_embd}, {m.n_head} heads, ctx "
        f"{m.block_size}, vocab {m.vocab_size:,}); {device}/{kernels}{ranks}",
        f"batch: {tc.batch_size} x {m.block_size} = {tokens:,} tokens/step; {opt} lr {tc.lr:g}, "
        f"{tc.warmup_steps:,} warm-up steps, {decay(tc, schedule)}",
        f"checkpoints: every {ck.every:,} steps into {run_dir} (last {ck.keep_last} kept + every "
        f"{ck.keep_every:,}th); replica: {replica}",
        f"target: step {stop_at:,} {begin}: {left:,} steps, {count(left * tokens)} tokens (`--steps N` moves it); "
        f"log every {tc.log_every}",
    ]


def decay(tc, schedule: str) -> str:
    """Where the lr ends: the schedule's own end, or a pivot's recorded anneal (optim/schedule.py), which replaces it."""
    if getattr(tc, "anneal_steps", 0):
        end = tc.anneal_at + tc.anneal_steps
        return f"annealed from step {tc.anneal_at:,} to {tc.min_lr:g} at {end:,} (a pivot's anneal)"
    return f"{schedule} to {tc.min_lr:g} at {tc.lr_decay_steps:,}"


def count(n: int) -> str:
    """3.26B, 30.7M, 512: a token count at a glance."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)
