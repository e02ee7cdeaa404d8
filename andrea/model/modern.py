"""The modern decoder (`model.arch = "modern"`): the 2026 recipe's model, parameters views into one flat fp32 buffer.

Rotary position embeddings (no position table), parameter-free RMSNorm before each sublayer and at the end,
QK-norm (an RMSNorm per head on q and k, before rotary, as Qwen3), a SwiGLU MLP, no biases and an untied head.
It is Qwen3's decoder with every norm weight fixed at one, so Hugging Face's stock `Qwen3ForCausalLM` loads its
export without custom code (andrea/model/qwen3.py says why that class; docs/operating.md, "The modern recipe").

nanochat's extras, each a ModelConfig key whose default is the model above, op for op (issue 54's ablation,
docs/benchmarks.md): `logit_softcap` (logits → c·tanh(logits/c)), `embed_norm` (an RMSNorm after the embedding),
`qk_scale` (q and k × s after QK-norm), `mlp = "relu2"` (relu(up)² through down, hidden 4C, no gate) and
`rope_base`. None adds a parameter; relu2 changes the MLP's matrices (below).

The flat-buffer machinery is the GPT's (andrea/model/gpt.py: `param_layout`, `bind_flat`, `decay_mask`,
`n_params`); this module adds the model, its initialisation and the MLP's width. Parameter-iteration order —
part of the checkpoint format (docs/formats.md), listed by `param_layout` and printed by `python -m andrea info`:
    wte.weight (V, C),
    for each layer i: h.i.attn.{q_proj, k_proj, v_proj, o_proj}.weight (C, C),
                      h.i.mlp.{gate_proj, up_proj}.weight (H, C), h.i.mlp.down_proj.weight (C, H),
    lm_head.weight (V, C).
H = `swiglu_hidden(C)` (andrea/config/schema.py). With model.mlp = "relu2" a block's MLP is
h.i.mlp.up_proj.weight (4C, C), h.i.mlp.down_proj.weight (C, 4C): no gate_proj. The norms have no parameters and no place in the buffer. Linear
weights are (out, in).

The math (`ModelMath`): attention, RMSNorm, QK-norm with rotary, and the loss come from torch (andrea/model/
torch_math.py, SDPA) or, with `--kernels triton`, the Triton kernels (`split_heads` composes QK-norm and rotary from
the RMSNorm and rotary kernels); neither changes a parameter or its order.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from andrea.config.schema import ModelConfig, swiglu_hidden
from andrea.model.gpt import ModelMath, ParamSpec, RmsNormFn, RotaryFn, _embedding, n_params

NORM_EPS = 1e-6  # every RMSNorm's eps (Qwen3's rms_norm_eps)


class RMSNorm(nn.Module):
    """Parameter-free RMSNorm over the last dim: x · rsqrt(mean(x²) + eps), its math from `fn`."""

    def __init__(self, fn: RmsNormFn):
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, NORM_EPS)


def split_heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float, *, rms_norm: RmsNormFn,
                rotary: RotaryFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QK-norm then rotary from separate RMSNorm and rotary functions (the Triton kernels'): qkv (B, T, 3, nh, hs),
    cos/sin (T, hs/2) → q, k, v (B, nh, T, hs). torch's math does the same in one Function (torch_math.qkv_heads)."""
    q, k, v = qkv.unbind(2)  # (B, T, nh, hs) each
    return (rotary(rms_norm(q, eps).transpose(1, 2), cos, sin), rotary(rms_norm(k, eps).transpose(1, 2), cos, sin),
            v.transpose(1, 2))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModelMath):
        super().__init__()
        C = cfg.n_embd
        self.n_head = cfg.n_head
        # Registration order below IS the checkpoint's parameter order; do not reorder.
        self.q_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, C, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.attention, self.qkv_heads = ops.attention, ops.qkv_heads
        self.qk_scale = cfg.qk_scale

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) → the q|k|v projection split into heads (B, T, 3, nh, hs).

        One matmul against the three weights concatenated (3C, C), as the GPT's c_attn: under bf16 autocast x is
        cast once and saved once for the backward, where three Linear calls would cast and save it three times."""
        B, T, C = x.shape
        w = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))  # (3C, C)
        return F.linear(x, w).view(B, T, 3, self.n_head, C // self.n_head)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(self.qkv_heads(self.qkv(x), cos, sin, NORM_EPS))  # (B, nh, T, hs) each
        y = self.attention(q, k, v)  # (B, nh, T, hs)
        return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(B, T, C)))


    def heads(self, qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The QK-normed, rotated q, k (× qk_scale: rotation is linear, so before or after it is the same math) and
        v, as they enter attention; unchanged (no op) at qk_scale 1."""
        q, k, v = qkv
        return (q, k, v) if self.qk_scale == 1.0 else (q * self.qk_scale, k * self.qk_scale, v)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, H = cfg.n_embd, swiglu_hidden(cfg.n_embd)
        self.gate_proj = nn.Linear(C, H, bias=False)
        self.up_proj = nn.Linear(C, H, bias=False)
        self.down_proj = nn.Linear(H, C, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gate and up in one matmul (2H, C), for the reason Attention.heads gives
        gate, up = F.linear(x, torch.cat((self.gate_proj.weight, self.up_proj.weight))).chunk(2, dim=-1)  # (B, T, H)
        return self.dropout(self.down_proj(F.silu(gate) * up))


class ReLU2(nn.Module):
    """nanochat's MLP (model.mlp = "relu2"): down(relu(up(x))²), hidden 4C, no gate matrix."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C = cfg.n_embd
        self.up_proj = nn.Linear(C, 4 * C, bias=False)
        self.down_proj = nn.Linear(4 * C, C, bias=False)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.relu(self.up_proj(x)).square()))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModelMath):
        super().__init__()
        self.norm_1 = RMSNorm(ops.rms_norm)
        self.attn = Attention(cfg, ops)
        self.norm_2 = RMSNorm(ops.rms_norm)
        self.mlp = ReLU2(cfg) if cfg.mlp == "relu2" else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), cos, sin)
        return x + self.mlp(self.norm_2(x))


class Modern(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModelMath = ModelMath()):
        super().__init__()
        if cfg.arch != "modern":
            raise ValueError(f"Modern needs model.arch=modern, not {cfg.arch!r}")
        self.cfg = cfg
        self.token_loss = ops.token_loss
        # Registration order below IS the checkpoint's parameter order; do not reorder.
        self.wte = _embedding(cfg.vocab_size, cfg.n_embd)
        self.norm_e = RMSNorm(ops.rms_norm) if cfg.embed_norm else None  # no parameter, no place in the buffer
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg, ops) for _ in range(cfg.n_layer))
        self.norm_f = RMSNorm(ops.rms_norm)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.checkpoint_blocks = False  # as GPT.checkpoint_blocks (andrea/model/gpt.py)
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin) (block_size, hs/2) fp32

    def rotary_tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (block_size, hs/2) fp32 on `device`, computed once per device (not parameters, not saved)."""
        if self._tables is None or self._tables[0].device != device:
            from andrea.kernels.rotary import rotary_tables
            self._tables = rotary_tables(self.cfg.block_size, self.cfg.n_embd // self.cfg.n_head, self.cfg.rope_base,
                                         device)
        return self._tables

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """idx (..., T) → the residual stream's start (..., T, C): the embedding, RMS-normalised with embed_norm."""
        x = self.wte(idx)
        return x if self.norm_e is None else self.norm_e(x)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream (..., C) → logits (..., V): final norm, lm_head, and c·tanh(logits/c) with
        logit_softcap c > 0 (in torch on either math: the Triton cross-entropy then reads the capped logits)."""
        logits = self.lm_head(self.norm_f(x))
        c = self.cfg.logit_softcap
        return logits if c == 0.0 else softcap(logits, c)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) → logits (B, T, V) and, with targets, the per-sequence mean loss (B,)."""
        B, T = idx.shape
        cos, sin = (t[:T] for t in self.rotary_tables(idx.device))  # (T, hs/2) each
        x = self.drop(self.embed(idx))  # (B, T, C)
        recompute = self.checkpoint_blocks and torch.is_grad_enabled()
        for block in self.h:
            x = checkpoint(block, x, cos, sin, use_reentrant=False) if recompute else block(x, cos, sin)
        logits = self.head(x)  # (B, T, V)
        if targets is None:
            return logits, None
        token_loss = self.token_loss(logits.view(-1, logits.size(-1)), targets.reshape(-1))  # (B·T,) fp32
        return logits, token_loss.view(B, T).mean(dim=1)


def softcap(logits: torch.Tensor, c: float) -> torch.Tensor:
    """c·tanh(logits / c) (..., V), in the logits' dtype: near the identity for |x| << c, bounded to (−c, c)."""
    return torch.tanh(logits / c) * c


def init_weights(layout: list[ParamSpec], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """Deterministic initialisation of the flat weights on CPU (nanochat's for this architecture).

    wte ~ N(0, 1): no norm follows the embedding, and the first RMSNorm sees unit-scale rows; q, k, v, gate and up
    ~ U(±√3/√C), std 1/√C, so each projection starts variance-preserving; o_proj and down_proj are zero, so every
    block starts as the identity on the residual stream (depth needs no 1/√L scale); lm_head ~ N(0, 0.001): the
    first logits are near zero and the loss starts at ln V.
    """
    gen = torch.Generator().manual_seed(seed)
    flat = torch.empty(n_params(layout), dtype=torch.float32)
    bound = math.sqrt(3.0 / cfg.n_embd)
    for spec in layout:
        view = flat[spec.offset:spec.offset + spec.numel]
        if spec.name == "wte.weight":
            view.normal_(0.0, 1.0, generator=gen)
        elif spec.name == "lm_head.weight":
            view.normal_(0.0, 0.001, generator=gen)
        elif spec.name.endswith(("o_proj.weight", "down_proj.weight")):
            view.zero_()
        else:
            view.uniform_(-bound, bound, generator=gen)
    return flat
