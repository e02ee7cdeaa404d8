"""The export of a modern model whose extras no stock `transformers` class expresses: its own modeling file.

Qwen3ForCausalLM (andrea/model/qwen3.py) expresses the modern model with `model.rope_base` (rope_theta) and
`model.qk_scale` (q_norm and k_norm weights equal to the scale: Qwen3 multiplies the normalised q and k by them),
so such a model still exports as that stock class. `logit_softcap`, `embed_norm` and `mlp = "relu2"` have no
Qwen3 counterpart: with any of them on, the export writes MODELING as `modeling_andrea.py` beside the weights and a
config.json of model_type "andrea_modern" whose `auto_map` names it, so that
`AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True)` loads it (and without trust_remote_code
transformers refuses the unknown type rather than build a stock Qwen3 that would compute other logits).

The file subclasses Qwen3's config and causal LM and swaps in, under Qwen3's own state-dict names (so the tensors,
their names and andrea/model/init_from.py's reading are qwen3.py's): an embedding followed by a parameter-free
RMSNorm (model.embed_tokens.weight), a head followed by c·tanh(x/c) (lm_head.weight), and a ReLU² MLP
(model.layers.i.mlp.{up,down}_proj.weight, no gate_proj). The extras' values are config.json keys
(logit_softcap, embed_norm, mlp) that `train --init-from` checks against the run's. Reads and writes nothing.
"""

from __future__ import annotations

from andrea.config.schema import ModelConfig
from andrea.model import qwen3

FILE_NAME = "modeling_andrea.py"
MODEL_TYPE = "andrea_modern"
EXTRA_KEYS = ("logit_softcap", "embed_norm", "mlp")  # config.json keys beyond Qwen3's


def stock(cfg: ModelConfig) -> bool:
    """Whether the stock Qwen3ForCausalLM computes this modern model (no extra beyond rope_base and qk_scale)."""
    return cfg.logit_softcap == 0.0 and not cfg.embed_norm and cfg.mlp == "swiglu"


def config(cfg: ModelConfig, eot: int | None) -> dict:
    """config.json: Qwen3's, or with a non-stock extra, model_type andrea_modern with its auto_map and extras."""
    out = qwen3.config(cfg, eot)
    if stock(cfg):
        return out
    return {**out, "architectures": ["AndreaModernForCausalLM"], "model_type": MODEL_TYPE,
            "auto_map": {"AutoConfig": "modeling_andrea.AndreaModernConfig",
                         "AutoModelForCausalLM": "modeling_andrea.AndreaModernForCausalLM"},
            "hidden_act": "relu2" if cfg.mlp == "relu2" else "silu",
            "logit_softcap": cfg.logit_softcap, "embed_norm": cfg.embed_norm, "mlp": cfg.mlp}


MODELING = '''"""andrea's modern decoder (written by `andrea export`): Qwen3's decoder with every norm weight one (q_norm and
k_norm: the run's model.qk_scale) and the extras no stock class has, from config.json: logit_softcap (logits ->
c * tanh(logits / c)), embed_norm (a parameter-free RMSNorm after the token embedding) and mlp = "relu2"
(down(relu(up(x))^2), no gate). Load with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True).
The tensors keep Qwen3's names. Passing inputs_embeds bypasses the embedding's norm."""

import torch
from torch import nn
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM


class AndreaModernConfig(Qwen3Config):
    model_type = "andrea_modern"  # config.json's logit_softcap, embed_norm and mlp are kept as attributes


class NormedEmbedding(nn.Embedding):
    """The token embedding, then x * rsqrt(mean(x^2) + eps) in fp32 (no weight)."""

    def __init__(self, num, dim, padding_idx, eps):
        super().__init__(num, dim, padding_idx)
        self.eps = eps

    def forward(self, ids):
        x = super().forward(ids)
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class CappedHead(nn.Linear):
    """The head, then c * tanh(logits / c)."""

    def __init__(self, dim, vocab, cap):
        super().__init__(dim, vocab, bias=False)
        self.cap = cap

    def forward(self, x):
        return torch.tanh(super().forward(x) / self.cap) * self.cap


class ReLU2MLP(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.down_proj(torch.relu(self.up_proj(x)).square())


class AndreaModernForCausalLM(Qwen3ForCausalLM):
    config_class = AndreaModernConfig

    def __init__(self, config):
        super().__init__(config)
        if getattr(config, "embed_norm", False):
            self.model.embed_tokens = NormedEmbedding(config.vocab_size, config.hidden_size, config.pad_token_id,
                                                      config.rms_norm_eps)
        if getattr(config, "logit_softcap", 0.0):
            self.lm_head = CappedHead(config.hidden_size, config.vocab_size, float(config.logit_softcap))
        if getattr(config, "mlp", "swiglu") == "relu2":
            for layer in self.model.layers:
                layer.mlp = ReLU2MLP(config.hidden_size, config.intermediate_size)
        self.post_init()
'''
