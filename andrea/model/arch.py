"""`model.arch`: which model a configuration builds, its parameter layout and its initialisation.

gpt2 → andrea/model/gpt.py's GPT, modern → andrea/model/modern.py's Modern. Both bind their parameters to the same
flat buffer machinery (gpt.py's `param_layout`, `bind_flat`, `decay_mask`), so the trainer, the checkpoint and the
optimizers see one flat `[w | m | v]` whatever the arch. Reads and writes nothing.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from andrea.config.schema import ModelConfig
from andrea.model import gpt, modern
from andrea.model.gpt import ModelMath, ParamSpec, param_layout

CLASSES: dict[str, type[nn.Module]] = {"gpt2": gpt.GPT, "modern": modern.Modern}


def build(cfg: ModelConfig, ops: ModelMath = ModelMath()) -> nn.Module:
    """The model of `cfg.arch` (on the current default device; the trainer builds it on meta, then binds it)."""
    return CLASSES[cfg.arch](cfg, ops)


def layout_for(cfg: ModelConfig) -> list[ParamSpec]:
    """The layout of a configuration without allocating it (a 120M model costs nothing here)."""
    with torch.device("meta"):
        return param_layout(build(cfg))


def init_weights(layout: list[ParamSpec], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """The flat fp32 weights (n,) at step 0, on CPU, a pure function of the layout, the config and the seed."""
    return (modern.init_weights if cfg.arch == "modern" else gpt.init_weights)(layout, cfg, seed)
