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
(model.layers.i.mlp.{up,down}_proj.weight, no gate_proj). nanochat's parts with parameters (model.value_embeds,
resid_lambdas, smear, backout) are modules added under andrea's own names with Qwen3's prefixes (qwen3.py's
`hf_name`: model.layers.i.self_attn.ve_gate.weight, model.value_embeds.i.weight, model.lambdas.{resid,x0},
model.smear.{lam,gate.weight}, model.backout.lam) and computed by hooks around Qwen3's own modules: the embedding's
output smeared, each decoder layer's input mixed with x0, v_proj's output plus the gated value embedding, the final
norm's input backed out. The extras' values are config.json keys (EXTRA_KEYS) that `train --init-from` checks
against the run's. Reads and writes nothing.
"""

from __future__ import annotations

from andrea.config.model import PARAM_EXTRAS
from andrea.config.schema import ModelConfig
from andrea.model import qwen3

FILE_NAME = "modeling_andrea.py"
MODEL_TYPE = "andrea_modern"
EXTRA_KEYS = ("logit_softcap", "embed_norm", "mlp") + PARAM_EXTRAS  # config.json keys beyond Qwen3's


def stock(cfg: ModelConfig) -> bool:
    """Whether the stock Qwen3ForCausalLM computes this modern model (no extra beyond rope_base and qk_scale)."""
    return cfg.logit_softcap == 0.0 and not cfg.embed_norm and cfg.mlp == "swiglu" and not any(
        getattr(cfg, k) for k in PARAM_EXTRAS)


def config(cfg: ModelConfig, eot: int | None) -> dict:
    """config.json: Qwen3's, or with a non-stock extra, model_type andrea_modern with its auto_map and extras."""
    out = qwen3.config(cfg, eot)
    if stock(cfg):
        return out
    return {**out, "architectures": ["AndreaModernForCausalLM"], "model_type": MODEL_TYPE,
            "auto_map": {"AutoConfig": "modeling_andrea.AndreaModernConfig",
                         "AutoModelForCausalLM": "modeling_andrea.AndreaModernForCausalLM"},
            "hidden_act": "relu2" if cfg.mlp == "relu2" else "silu",
            **{k: getattr(cfg, k) for k in EXTRA_KEYS}}


MODELING = '''"""andrea's modern decoder (written by `andrea export`): Qwen3's decoder with every norm weight one (q_norm and
k_norm: the run's model.qk_scale) and the extras no stock class has, from config.json: logit_softcap (logits ->
c * tanh(logits / c)), embed_norm (a parameter-free RMSNorm after the token embedding) and mlp = "relu2"
(down(relu(up(x))^2), no gate), and nanochat's parts with parameters: value_embeds (a token embedding added to v
in every other layer ending with the last, gated per head by 3 * sigmoid over the first 12 channels of the
attention's input), resid_lambdas (layer i's input r_i * x + a_i * x0), smear (the previous token's embedding added
through lam * sigmoid(gate . its first 24 channels)) and backout (beta * the stream after layer n // 2 subtracted
before the final norm). Load with AutoModelForCausalLM.from_pretrained(dir, trust_remote_code=True). The tensors
keep Qwen3's names, the parts andrea's under Qwen3's prefixes. Passing inputs_embeds bypasses the embedding's norm
and the parts' token-dependent inputs. In a left-padded batch (its attention_mask 0 over the padding) a row's first
token is smeared with nothing, as at position 0."""

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
        add_parts(self.model, config)
        self.post_init()

    def forward(self, input_ids=None, *args, **kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        self.model.parts_ids = input_ids  # what the hooks read (add_parts)
        self.model.parts_start = 0 if cache is None else int(cache.get_seq_length())
        mask = kwargs.get("attention_mask", args[0] if args else None)  # (B, past + T): 0 over padding
        self.model.parts_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        return super().forward(input_ids, *args, **kwargs)


def has_value_embed(layer, n_layer):
    return layer % 2 == (n_layer - 1) % 2


class Scalars(nn.Module):
    def __init__(self, **parts):
        super().__init__()
        for name, part in parts.items():
            setattr(self, name, part if isinstance(part, nn.Module) else nn.Parameter(torch.zeros(part)))


def add_parts(model, config):
    """The parts config.json turns on, as modules of the Qwen3Model `model` and hooks around its own modules."""
    n, heads = config.num_hidden_layers, config.num_attention_heads
    if getattr(config, "value_embeds", False):
        model.value_embeds = nn.ModuleDict({str(i): nn.Embedding(config.vocab_size, config.hidden_size)
                                            for i in range(n) if has_value_embed(i, n)})
        for i, layer in enumerate(model.layers):
            if has_value_embed(i, n):
                layer.self_attn.ve_gate = nn.Linear(12, heads, bias=False)
                layer.self_attn.v_proj.register_forward_hook(
                    lambda m, args, out, i=i, attn=layer.self_attn: mix_value(model, i, attn, args[0], out))
    if getattr(config, "resid_lambdas", False):
        model.lambdas = Scalars(resid=n, x0=n)
        for i, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(lambda m, args, kwargs, i=i: mix_stream(model, i, args, kwargs),
                                            with_kwargs=True)
    if getattr(config, "smear", False):
        model.smear = Scalars(lam=1, gate=nn.Linear(24, 1, bias=False))
    model.embed_tokens.register_forward_hook(lambda m, args, out: smeared(model, out))
    if getattr(config, "backout", False):
        model.backout = Scalars(lam=1)
        model.layers[n // 2].register_forward_hook(lambda m, args, out: setattr(
            model, "parts_middle", out[0] if isinstance(out, tuple) else out))
        model.norm.register_forward_pre_hook(lambda m, args: (args[0] - model.backout.lam * model.parts_middle,))


def smeared(model, e):
    """The embedding's output e (B, T, C), smeared (with smear), kept as x0 for the lambdas."""
    if getattr(model, "smear", None) is not None:
        B, T, _ = e.shape
        start = getattr(model, "parts_start", 0)
        gate = model.smear.lam * torch.sigmoid(model.smear.gate(e[..., :24]))  # (B, T, 1)
        mask = getattr(model, "parts_mask", None)
        if mask is not None and mask.shape == (B, start + T):  # smear only where the predecessor is a token
            real = torch.cat([mask.new_zeros(B, 1), mask], dim=1)[:, start:start + T]  # (B, T): is token t-1 one
            gate = gate * real[..., None].to(gate.dtype)
        if start == 0:
            x = torch.cat([e[:, :1], e[:, 1:] + gate[:, 1:] * e[:, :-1]], dim=1)
        else:  # a cached decode: the previous call's last embedding precedes this one's first
            x = e + gate * torch.cat([model.parts_last, e[:, :-1]], dim=1)
        model.parts_last = e[:, -1:]
        e = x
    model.parts_x0 = e
    return e


def mix_stream(model, i, args, kwargs):
    """Layer i's input hidden_states (first argument or keyword) -> r_i * x + a_i * x0."""
    lam = model.lambdas
    if args:
        return (lam.resid[i] * args[0] + lam.x0[i] * model.parts_x0, *args[1:]), kwargs
    x = kwargs["hidden_states"]
    return args, {**kwargs, "hidden_states": lam.resid[i] * x + lam.x0[i] * model.parts_x0}


def mix_value(model, i, attn, x, v):
    """v_proj's output v (B, T, C) plus layer i's value embedding gated per head by its input x's first 12."""
    B, T, C = v.shape
    heads = attn.ve_gate.out_features
    gate = 3 * torch.sigmoid(attn.ve_gate(x[..., :12]))  # (B, T, heads)
    ve = model.value_embeds[str(i)](model.parts_ids).view(B, T, heads, C // heads)
    return v + (gate[..., None] * ve).view(B, T, C)
'''
