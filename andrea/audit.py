"""Read-only looks at the model between steps: validation loss and sample audits.

Both run on the training thread at a step boundary and leave training's state and randomness untouched:
evaluation uses a fixed set of held-out windows per arm (drawn from the EVAL stream keyed by the seed only,
so every eval of a run scores the same text), and sampling draws from its own generator keyed by
(seed, step). Cost is bounded: `train.eval_batches` forward passes per arm; `len(sample.prompts)` ×
`sample.max_new_tokens` single-sequence forwards per audit.
"""

from __future__ import annotations

import numpy as np
import torch

from andrea.config import RunConfig
from andrea.data.store import EVAL_STREAM, SAMPLE_STREAM, ArmTokens, TextCodec, rng_for, rows
from andrea.trainer import Trainer


def evaluate(trainer: Trainer, arms: list[ArmTokens], cfg: RunConfig) -> dict[str, float]:
    """Mean held-out loss per arm."""
    losses = {}
    B = cfg.train.batch_size
    for a, arm in enumerate(arms):
        rng = rng_for(cfg.train.seed, 0, EVAL_STREAM, a)
        total = 0.0
        for _ in range(cfg.train.eval_batches):
            x, y = rows(arms, np.full(B, a), cfg.model.block_size, rng, split="val")
            total += float(trainer.loss_of(x, y))
        losses[arm.name] = total / cfg.train.eval_batches
    return losses


def sample_audits(trainer: Trainer, codec: TextCodec, cfg: RunConfig, step: int) -> list[dict]:
    sc = cfg.sample
    seed = int(rng_for(cfg.train.seed, step, SAMPLE_STREAM).integers(2**62))
    gen = torch.Generator().manual_seed(seed)
    audits = []
    for prompt in sc.prompts:
        ids = codec.encode(prompt) or [codec.eot]
        new = trainer.generate(ids, sc.max_new_tokens, temperature=sc.temperature, top_k=sc.top_k, generator=gen)
        audits.append({"step": step, "prompt": prompt, "text": codec.decode(new)})
    return audits
