"""The model tests' live modern model (tests/unit/model/test_extras.py, test_parts.py): every weight drawn far from
its initialisation, so that each extra or part moves the logits. Reads and writes nothing."""

from __future__ import annotations

import torch

from andrea.config.schema import ModelConfig
from andrea.model import arch
from andrea.model.gpt import ModelMath
from andrea.model.modern import Modern


def live_model(keys: dict, ops: ModelMath = ModelMath(), seed: int = 5) -> Modern:
    """The model of ModelConfig(**keys), in eval mode, every weight N(0, 0.3²) from `seed`."""
    model = arch.build(ModelConfig(**keys), ops).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def tokens(rows: int = 3, T: int = 16) -> torch.Tensor:
    return torch.randint(0, 300, (rows, T), generator=torch.Generator().manual_seed(0))
