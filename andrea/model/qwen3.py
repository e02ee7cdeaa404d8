"""The modern model as Hugging Face's `Qwen3ForCausalLM`: names, the config and the norm weights, both ways.

Why Qwen3: among the decoders `transformers` ships, it is the one whose math is andrea's modern model op for op —
RMSNorm before each sublayer and at the end, QK-norm (an RMSNorm per head on q and k, applied before rotary),
half-split rotary (`rotate_half`), a SwiGLU MLP (SiLU gate), no biases (`attention_bias = false`), an untied head
(`tie_word_embeddings = false`) and the 1/√head_dim attention scale. Llama and Mistral have no QK-norm; Gemma 3
has one but scales the embedding by √C, gates with GELU and normalises after each sublayer too; OLMo-2 normalises
after the sublayers, and q and k as a whole rather than per head. Qwen3's norms carry weights:
andrea's have none, so an export writes them as ones (x · 1 is x exactly) and an import refuses any other value;
q_norm and k_norm are written as model.qk_scale (1 by default): Qwen3 multiplies the normalised q and k by them,
as andrea multiplies them by the scale. The extras Qwen3 cannot express (logit softcap, embedding norm, ReLU²,
and the parts with parameters: value embeddings, lambdas, smear, backout) export with andrea's own modeling file
under the same names, the parts' under `hf_name`'s prefixes (andrea/model/hf_modeling.py).

Name mapping, andrea layout name → Qwen3ForCausalLM state-dict name (no transposes: both keep Linear's (out, in)):
    wte.weight (V, C)                         model.embed_tokens.weight
    h.i.attn.{q,k,v,o}_proj.weight (C, C)     model.layers.i.self_attn.{q,k,v,o}_proj.weight
    h.i.mlp.{gate,up}_proj.weight (H, C)      model.layers.i.mlp.{gate,up}_proj.weight
    h.i.mlp.down_proj.weight (C, H)           model.layers.i.mlp.down_proj.weight
    lm_head.weight (V, C)                     lm_head.weight
    (no parameter: ones)                      model.layers.i.{input,post_attention}_layernorm.weight (C),
                                              model.layers.i.self_attn.{q,k}_norm.weight (head_dim),
                                              model.norm.weight (C)
Reads and writes nothing; andrea/model/export.py writes the directory, andrea/model/init_from.py reads the files.
"""

from __future__ import annotations

import re

import numpy as np

from andrea.config.schema import ModelConfig, mlp_hidden
from andrea.model.modern import NORM_EPS

PREFIX = "model."
_LAYER = re.compile(r"^h\.(\d+)\.(attn|mlp)\.(.+)$")
_HF_LAYER = re.compile(r"^layers\.(\d+)\.(self_attn|mlp)\.(.+)$")
NORM = re.compile(r"^(layers\.\d+\.(input_layernorm|post_attention_layernorm|self_attn\.[qk]_norm)|norm)\.weight$")
IGNORED = re.compile(r"^(layers\.\d+\.self_attn\.)?rotary_emb\.inv_freq$")  # older files' rotary buffers


def hf_name(name: str) -> str:
    """andrea's layout name → Qwen3ForCausalLM's (any other name, as `andrea_name` leaves it, gets the prefix)."""
    if name == "lm_head.weight":
        return name
    if name == "wte.weight":
        return PREFIX + "embed_tokens.weight"
    m = _LAYER.match(name)
    if m is None:
        return PREFIX + name
    layer, part, rest = m.groups()
    return f"{PREFIX}layers.{layer}.{'self_attn' if part == 'attn' else 'mlp'}.{rest}"


def andrea_name(name: str) -> str:
    """Qwen3's state-dict name (with or without the base model's `model.` prefix) → andrea's layout name; a name
    with no andrea counterpart (a norm, or anything else) comes back unchanged, prefix removed."""
    if name == "lm_head.weight":
        return name
    bare = name.removeprefix(PREFIX)
    if bare == "embed_tokens.weight":
        return "wte.weight"
    m = _HF_LAYER.match(bare)
    if m and not m.group(3).endswith("norm.weight"):
        return f"h.{m.group(1)}.{'attn' if m.group(2) == 'self_attn' else 'mlp'}.{m.group(3)}"
    return bare


def norm_value(bare_name: str, cfg: ModelConfig) -> float:
    """The value every element of a norm weight has in andrea's model: model.qk_scale for q_norm and k_norm
    (Qwen3 multiplies the normalised q and k by them, as andrea does by the scale), 1 for the others."""
    return cfg.qk_scale if bare_name.endswith(("q_norm.weight", "k_norm.weight")) else 1.0


def norm_shapes(cfg: ModelConfig) -> dict[str, tuple[int]]:
    """Every norm weight Qwen3 has and andrea's model fixes at one: name (without the prefix) → shape."""
    C, hs = cfg.n_embd, cfg.n_embd // cfg.n_head
    out: dict[str, tuple[int]] = {}
    for i in range(cfg.n_layer):
        out[f"layers.{i}.input_layernorm.weight"] = (C,)
        out[f"layers.{i}.self_attn.q_norm.weight"] = (hs,)
        out[f"layers.{i}.self_attn.k_norm.weight"] = (hs,)
        out[f"layers.{i}.post_attention_layernorm.weight"] = (C,)
    out["norm.weight"] = (C,)
    return out


def norm_tensors(cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The norms' weights as the export writes them, float32, under Qwen3's full names: ones, q_norm and k_norm
    model.qk_scale."""
    return {PREFIX + name: np.full(shape, norm_value(name, cfg), dtype=np.float32)
            for name, shape in norm_shapes(cfg).items()}


def config(cfg: ModelConfig, eot: int | None) -> dict:
    """config.json for Qwen3ForCausalLM. The rotary base is written both as transformers 5's `rope_parameters`
    and as 4.x's `rope_theta`, so either version reads it."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.n_embd, "intermediate_size": mlp_hidden(cfg),
        "num_hidden_layers": cfg.n_layer, "num_attention_heads": cfg.n_head, "num_key_value_heads": cfg.n_head,
        "head_dim": cfg.n_embd // cfg.n_head, "hidden_act": "silu", "max_position_embeddings": cfg.block_size,
        "rms_norm_eps": NORM_EPS, "rope_theta": cfg.rope_base,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
        "attention_bias": False, "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        "layer_types": ["full_attention"] * cfg.n_layer, "tie_word_embeddings": False, "initializer_range": 0.02,
        "use_cache": True, "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32",
    }


def is_norm(bare_name: str) -> bool:
    """Whether a Qwen3 state-dict name (prefix removed) is one of the norm weights andrea fixes (`norm_value`)."""
    return NORM.match(bare_name) is not None
