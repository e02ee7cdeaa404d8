"""The run's model section, configured: the architecture and its shape (`[model]`), and the widths derived from it.

One section of the schema (andrea/config/schema.py holds RunConfig and the rest, andrea/config/corpus.py the data's,
andrea/config/keepers.py the guard's, the watchdog's and the notices'): a dataclass with a docstring per field,
checked on construction; andrea/config/doc.py reads it for docs/configuration.md. The model's extras (nanochat's:
softcap, embedding norm, q/k scale, ReLU², rotary base; value embeddings, residual lambdas, smear, backout) are keys
here whose defaults are the plain modern model.
Reads and writes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from andrea.config.check import ConfigError


ARCHS = ("gpt2", "modern")
MLPS = ("swiglu", "relu2")  # model.mlp (arch = modern)
VE_GATE_CHANNELS = 12  # model.value_embeds: the gate reads the first 12 channels of the attention's input
SMEAR_CHANNELS = 24  # model.smear: the gate reads the first 24 channels of the embedding
# the extras that add parameters (andrea/model/modern.py; docs/formats.md says where they sit)
PARAM_EXTRAS = ("value_embeds", "resid_lambdas", "smear", "backout")


def value_embed_layers(n_layer: int) -> list[int]:
    """The layers with a value embedding (model.value_embeds): every other one, the last included (nanochat's)."""
    return [i for i in range(n_layer) if i % 2 == (n_layer - 1) % 2]


def mlp_hidden(cfg: "ModelConfig") -> int:
    """The modern model's MLP hidden width: `swiglu_hidden` for model.mlp = swiglu, 4·n_embd for relu2."""
    return 4 * cfg.n_embd if cfg.mlp == "relu2" else swiglu_hidden(cfg.n_embd)


def swiglu_hidden(n_embd: int) -> int:
    """The modern model's SwiGLU hidden width H: its three (H, C) matrices hold as many parameters as the GPT's two
    (4C, C) ones when H = 8C/3, rounded to the nearest multiple of 64 (matmul tiles; Llama rounds up to 256, too
    coarse at andrea's widths), at least 64. C = 320 → 832, C = 768 → 2048."""
    return max(64, round(8 * n_embd / 3 / 64) * 64)


@dataclass
class ModelConfig:
    """The model (`arch`) and its shape; the shape fixes n_params and so the checkpoint size (8 + 12·n bytes)."""

    arch: str = "gpt2"
    """gpt2 | modern. gpt2 (andrea/model/gpt.py): learned positions, LayerNorm with biases, GELU MLP, as in 2019.
    modern (andrea/model/modern.py): rotary positions (no position table), parameter-free RMSNorm before each
    sublayer and at the end, QK-norm, SwiGLU MLP (hidden size 8·n_embd/3 rounded to a multiple of 64), no biases,
    an untied head: what Hugging Face's Qwen3ForCausalLM loads (`andrea export`)."""

    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width of the residual stream (embedding size)."""
    block_size: int = 128
    """Context length; for gpt2 also the number of learned position embeddings."""
    vocab_size: int = 4096
    """Size of the byte-level BPE vocabulary trained at the run's first start (at least 256 + specials); token
    files are uint16 up to 65,536 and uint32 above."""
    dropout: float = 0.0
    """0 for long pretraining runs; when > 0 the dropout RNG is seeded from (seed, step) so resume stays exact."""
    bias: bool = True
    """Biases in Linear and LayerNorm, as GPT-2 (arch = gpt2 only: the modern model has no biases)."""
    rope_base: float = 10_000.0
    """Rotary position embeddings' base (arch = modern): pair i of a head turns by position ·
    rope_base^(−2i/head_dim). nanochat's is 1e5."""
    logit_softcap: float = 0.0
    """arch = modern: the logits pass through c·tanh(logits / c) with c = logit_softcap, bounding them to (−c, c);
    0 (the default) leaves them as the head computes them. nanochat's is 15. Under `--kernels triton` the cap is
    torch's, applied before the fused cross-entropy."""
    embed_norm: bool = False
    """arch = modern: a parameter-free RMSNorm right after the token embedding (nanochat's)."""
    qk_scale: float = 1.0
    """arch = modern: q and k multiplied by this after QK-norm (attention logits × qk_scale²); nanochat's is 1.2.
    An export writes it as Qwen3's q_norm and k_norm weights."""
    mlp: str = "swiglu"
    """arch = modern: swiglu | relu2. swiglu: silu(gate) · up with hidden width 8·n_embd/3 (three matrices).
    relu2: relu(up)² with hidden width 4·n_embd (nanochat's): two matrices, up_proj (4C, C) and down_proj (C, 4C),
    no gate_proj; as many parameters as swiglu's to within the width's rounding."""
    value_embeds: bool = False
    """arch = modern: value embeddings with gates (nanochat's, ResFormer's): every other layer, the last included,
    has its own (V, C) token embedding added to attention's v, per head gated by 3·sigmoid of a (n_head, 12) matrix
    over the first 12 channels of the attention's input. Adds (V, C) per such layer."""
    resid_lambdas: bool = False
    """arch = modern: before each block i the residual stream becomes r_i·x + a_i·x0 (x0: the embedding as the
    first block would see it), two learned scalars per layer (nanochat's resid_lambdas and x0_lambdas, started at
    1.15 → 1.05 and 0.20 → 0.05 across the layers)."""
    smear: bool = False
    """arch = modern: each token's embedding gets the previous token's added, gated by λ·sigmoid of a (1, 24)
    vector over its first 24 channels (nanochat's smear; λ starts at 0: the model starts without it)."""
    backout: bool = False
    """arch = modern: before the final norm, β times the residual stream after the middle block (n_layer // 2) is
    subtracted (nanochat's backout; β learned, started at 0.2)."""

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ConfigError(f"model.arch={self.arch!r} must be one of {', '.join(ARCHS)}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"model.n_embd={self.n_embd} is not a multiple of model.n_head={self.n_head}")
        if self.arch == "modern" and (self.n_embd // self.n_head) % 2:
            raise ConfigError(f"model.arch=modern: rotary needs an even head dim, and n_embd / n_head = "
                              f"{self.n_embd // self.n_head}")
        if self.mlp not in MLPS:
            raise ConfigError(f"model.mlp={self.mlp!r} must be one of {', '.join(MLPS)}")
        if self.logit_softcap < 0.0 or not self.qk_scale > 0.0:
            raise ConfigError(f"model.logit_softcap={self.logit_softcap} must be >= 0 (0: none) and "
                              f"model.qk_scale={self.qk_scale} > 0")
        if self.arch != "modern" and (self.logit_softcap, self.embed_norm, self.qk_scale, self.mlp) != (
                0.0, False, 1.0, "swiglu"):
            raise ConfigError(f"model.arch={self.arch!r}: logit_softcap, embed_norm, qk_scale and mlp are the modern "
                              f"model's (model.arch = \"modern\")")
        if self.arch != "modern" and any(getattr(self, k) for k in PARAM_EXTRAS):
            raise ConfigError(f"model.arch={self.arch!r}: {', '.join(PARAM_EXTRAS)} are the modern model's "
                              f"(model.arch = \"modern\")")
        for key, width in (("value_embeds", VE_GATE_CHANNELS), ("smear", SMEAR_CHANNELS)):
            if getattr(self, key) and self.n_embd < width:
                raise ConfigError(f"model.{key}: its gate reads the first {width} channels, and model.n_embd is "
                                  f"{self.n_embd}")
        if not self.rope_base > 1.0:
            raise ConfigError(f"model.rope_base={self.rope_base} must be > 1")
        if self.vocab_size < 260:
            raise ConfigError(f"model.vocab_size={self.vocab_size} must be at least 260 (256 bytes + specials)")
        if self.vocab_size > 2**31 - 1:
            raise ConfigError(f"model.vocab_size={self.vocab_size} must fit int32 token ids")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        for name in ("n_layer", "n_head", "n_embd", "block_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1")
