"""The modern decoder (`model.arch = "modern"`): the 2026 recipe's model, parameters views into one flat fp32 buffer.

Rotary position embeddings (no position table), parameter-free RMSNorm before each sublayer and at the end,
QK-norm (an RMSNorm per head on q and k, before rotary, as Qwen3), a SwiGLU MLP, no biases and an untied head.
It is Qwen3's decoder with every norm weight fixed at one, so Hugging Face's stock `Qwen3ForCausalLM` loads its
export without custom code (andrea/model/qwen3.py says why that class; docs/operating.md, "The modern recipe").

nanochat's extras, each a ModelConfig key whose default is the model above, op for op (issue 54's ablation,
docs/benchmarks.md): `logit_softcap` (logits → c·tanh(logits/c)), `embed_norm` (an RMSNorm after the embedding),
`qk_scale` (q and k × s after QK-norm), `mlp = "relu2"` (relu(up)² through down, hidden 4C, no gate) and
`rope_base`. None adds a parameter; relu2 changes the MLP's matrices (below). Four more are nanochat's parts with
parameters (each a bool key, off by default): `value_embeds` (a token embedding added to v in every other layer,
gated per head), `resid_lambdas` (x ← r_i·x + a_i·x0 before block i), `smear` (the previous token's embedding
mixed in through a gate) and `backout` (β × the stream after the middle block subtracted before the final norm).

The flat-buffer machinery is the GPT's (andrea/model/gpt.py: `param_layout`, `bind_flat`, `decay_mask`,
`n_params`); this module adds the model, its initialisation and the MLP's width. Parameter-iteration order —
part of the checkpoint format (docs/formats.md), listed by `param_layout` and printed by `python -m andrea info`:
    wte.weight (V, C),
    for each layer i: h.i.attn.{q_proj, k_proj, v_proj, o_proj}.weight (C, C),
                      h.i.mlp.{gate_proj, up_proj}.weight (H, C), h.i.mlp.down_proj.weight (C, H),
    lm_head.weight (V, C).
H = `swiglu_hidden(C)` (andrea/config/schema.py). With model.mlp = "relu2" a block's MLP is
h.i.mlp.up_proj.weight (4C, C), h.i.mlp.down_proj.weight (C, 4C): no gate_proj. The norms have no parameters and no
place in the buffer. Linear weights are (out, in). The parts with parameters add, each only when on:
    value_embeds:  h.i.attn.ve_gate.weight (n_head, 12) after h.i.attn.o_proj.weight, in each layer i that has one
                   (`has_value_embed`), and value_embeds.i.weight (V, C) after lm_head.weight, for those layers;
    resid_lambdas: lambdas.resid (L), lambdas.x0 (L), after those;
    smear:         smear.lam (1), smear.gate.weight (1, 24), after those;
    backout:       backout.lam (1), last.

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

from andrea.config.model import SMEAR_CHANNELS, VE_GATE_CHANNELS, value_embed_layers
from andrea.config.schema import ModelConfig, swiglu_hidden
from andrea.model.gpt import ModelMath, ParamSpec, RmsNormFn, RotaryFn, _embedding, n_params

NORM_EPS = 1e-6  # every RMSNorm's eps (Qwen3's rms_norm_eps)


def has_value_embed(layer: int, n_layer: int) -> bool:
    """Whether block `layer` has a value embedding (model.value_embeds): every other layer, the last included."""
    return layer in value_embed_layers(n_layer)


def lambda_inits(n_layer: int) -> tuple[list[float], list[float]]:
    """resid_lambdas' and x0_lambdas' starting values: 1.15 → 1.05 and 0.20 → 0.05, linear over the layers."""
    f = [i / max(n_layer - 1, 1) for i in range(n_layer)]
    return [1.15 - 0.10 * x for x in f], [0.20 - 0.15 * x for x in f]


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
        self.ve_gate = None  # a (n_head, 12) gate when the block has a value embedding (Block sets it)

    def qkv(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) → the q|k|v projection split into heads (B, T, 3, nh, hs).

        One matmul against the three weights concatenated (3C, C), as the GPT's c_attn: under bf16 autocast x is
        cast once and saved once for the backward, where three Linear calls would cast and save it three times."""
        B, T, C = x.shape
        w = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))  # (3C, C)
        return F.linear(x, w).view(B, T, 3, self.n_head, C // self.n_head)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ve: torch.Tensor | None = None
                ) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.heads(self.qkv_heads(self.qkv(x), cos, sin, NORM_EPS))  # (B, nh, T, hs) each
        y = self.attention(q, k, self.mix_value(x, v, ve))  # (B, nh, T, hs)
        return self.resid_dropout(self.o_proj(y.transpose(1, 2).reshape(B, T, C)))

    def mix_value(self, x: torch.Tensor, v: torch.Tensor, ve: torch.Tensor | None) -> torch.Tensor:
        """v (B, nh, T, hs) plus the value embedding ve (B, T, C) gated per head by 3·sigmoid(ve_gate · x[..., :12])
        (x: the attention's input (B, T, C)); v itself without one."""
        if ve is None:
            return v
        B, nh, T, hs = v.shape
        gate = 3 * torch.sigmoid(F.linear(x[..., :VE_GATE_CHANNELS], self.ve_gate.weight))  # (B, T, nh)
        return v + gate.transpose(1, 2)[..., None] * ve.view(B, T, nh, hs).transpose(1, 2)

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
    def __init__(self, cfg: ModelConfig, ops: ModelMath, layer: int = 0):
        super().__init__()
        self.norm_1 = RMSNorm(ops.rms_norm)
        self.attn = Attention(cfg, ops)
        if cfg.value_embeds and has_value_embed(layer, cfg.n_layer):  # registered after o_proj
            self.attn.ve_gate = nn.Linear(VE_GATE_CHANNELS, cfg.n_head, bias=False)
        self.norm_2 = RMSNorm(ops.rms_norm)
        self.mlp = ReLU2(cfg) if cfg.mlp == "relu2" else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ve: torch.Tensor | None = None
                ) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x), cos, sin, ve)
        return x + self.mlp(self.norm_2(x))


class Scalars(nn.Module):
    """A few parameters under one prefix, in the order given: name=n for an (n,) vector, or a module."""

    def __init__(self, **parts: int | nn.Module):
        super().__init__()
        for name, part in parts.items():
            setattr(self, name, part if isinstance(part, nn.Module) else nn.Parameter(torch.zeros(part)))


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
        self.h = nn.ModuleList(Block(cfg, ops, i) for i in range(cfg.n_layer))
        self.norm_f = RMSNorm(ops.rms_norm)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # nanochat's parts with parameters, each registered only when on (the plain model's layout unchanged)
        L = cfg.n_layer
        self.value_embeds = nn.ModuleDict({str(i): _embedding(cfg.vocab_size, cfg.n_embd) for i in range(L)
                                           if has_value_embed(i, L)}) if cfg.value_embeds else None
        # (in submodules: a module's own parameters would come before its children's in the layout)
        self.lambdas = Scalars(resid=L, x0=L) if cfg.resid_lambdas else None
        self.smear = Scalars(lam=1, gate=nn.Linear(SMEAR_CHANNELS, 1, bias=False)) if cfg.smear else None
        self.backout = Scalars(lam=1) if cfg.backout else None
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

    def smeared(self, x: torch.Tensor, prev: torch.Tensor | None = None, first: torch.Tensor | None = None
                ) -> torch.Tensor:
        """model.smear: x (B, T, C) embeddings, each plus λ·sigmoid(smear_gate · its first 24 channels) times the
        previous token's. Training's whole sequences (prev None): positions 1.. take their predecessor, position 0
        nothing. The cached decode (andrea/model/generate.py) passes prev (B, 1, C), the embedding before the first
        slot (zeros at a start), and first (B, T) true where a slot has no predecessor (a row's position 0)."""
        if self.smear is None:
            return x
        gate = self.smear.lam * torch.sigmoid(self.smear.gate(x[..., :SMEAR_CHANNELS]))  # (B, T, 1)
        if prev is None:
            return torch.cat([x[:, :1], x[:, 1:] + gate[:, 1:] * x[:, :-1]], dim=1)
        before = torch.cat([prev, x[:, :-1]], dim=1)  # (B, T, C): each slot's predecessor
        return x + (gate * before).masked_fill(first[..., None], 0.0)

    def value_embed(self, i: int, idx: torch.Tensor) -> torch.Tensor | None:
        """Block i's value embedding of the tokens idx (..., T) → (..., T, C), or None (none at this layer)."""
        if self.value_embeds is None or str(i) not in self.value_embeds:
            return None
        return self.value_embeds[str(i)](idx)

    def mixed(self, i: int, x: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        """Block i's input: r_i·x + a_i·x0 with model.resid_lambdas, x itself without."""
        return x if self.lambdas is None else self.lambdas.resid[i] * x + self.lambdas.x0[i] * x0

    def backed_out(self, x: torch.Tensor, middle: torch.Tensor | None) -> torch.Tensor:
        """The stream before the final norm: x − β·middle with model.backout (middle: after block n_layer // 2)."""
        return x if self.backout is None else x - self.backout.lam * middle

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
        x = self.drop(self.smeared(self.embed(idx)))  # (B, T, C)
        x0, middle = x, None
        recompute = self.checkpoint_blocks and torch.is_grad_enabled()
        for i, block in enumerate(self.h):
            x, ve = self.mixed(i, x, x0), self.value_embed(i, idx)
            x = checkpoint(block, x, cos, sin, ve, use_reentrant=False) if recompute else block(x, cos, sin, ve)
            middle = x if i == self.cfg.n_layer // 2 else middle
        logits = self.head(self.backed_out(x, middle))  # (B, T, V)
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
    first logits are near zero and the loss starts at ln V. The parts' (nanochat's): value embeddings as v_proj,
    the gates ~ U(0, 0.02), the lambdas `lambda_inits`, smear's λ 0 and backout's β 0.2.
    """
    gen = torch.Generator().manual_seed(seed)
    flat = torch.empty(n_params(layout), dtype=torch.float32)
    bound = math.sqrt(3.0 / cfg.n_embd)
    resid, x0 = lambda_inits(cfg.n_layer)
    fixed = {"lambdas.resid": resid, "lambdas.x0": x0, "smear.lam": [0.0], "backout.lam": [0.2]}
    for spec in layout:
        view = flat[spec.offset:spec.offset + spec.numel]
        if spec.name in fixed:
            view.copy_(torch.tensor(fixed[spec.name]))
        elif spec.name.endswith(("ve_gate.weight", "smear.gate.weight")):  # gates start a little above neutral
            view.uniform_(0.0, 0.02, generator=gen)
        elif spec.name == "wte.weight":
            view.normal_(0.0, 1.0, generator=gen)
        elif spec.name == "lm_head.weight":
            view.normal_(0.0, 0.001, generator=gen)
        elif spec.name.endswith(("o_proj.weight", "down_proj.weight")):
            view.zero_()
        else:
            view.uniform_(-bound, bound, generator=gen)
    return flat
