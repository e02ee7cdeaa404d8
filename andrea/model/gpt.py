"""The GPT model, whose parameters are views into one flat fp32 buffer in checkpoint order.

A GPT-2 style decoder: learned token and position embeddings, pre-LayerNorm blocks (causal self-attention,
GELU MLP), a final LayerNorm and an output head. The head is NOT tied to the token embedding: docs/formats.md lists
the output head as its own region of the flat weights, and an untied head keeps every parameter a plain view
(export to HF GPT-2 sets `tie_word_embeddings = False`).

Parameter-iteration order — part of the checkpoint format (docs/formats.md), listed by `param_layout` and printed by
`python -m andrea info`:
    wte.weight (V, C), wpe.weight (T, C),
    for each layer i: h.i.ln_1.{weight,bias} (C), h.i.attn.c_attn.{weight (3C, C), bias (3C)},
                      h.i.attn.c_proj.{weight (C, C), bias (C)}, h.i.ln_2.{weight,bias} (C),
                      h.i.mlp.c_fc.{weight (4C, C), bias (4C)}, h.i.mlp.c_proj.{weight (C, 4C), bias (C)},
    ln_f.{weight,bias} (C), lm_head.weight (V, C).
Linear weights are stored (out, in) as torch keeps them. With bias = false the bias entries are absent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from andrea.config.schema import ModelConfig
from andrea.model.torch_math import qkv_heads, rms_norm

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
LayerNormFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, float], torch.Tensor]
TokenLossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # logits (N, V), targets (N,) → fp32 (N,)
RmsNormFn = Callable[[torch.Tensor, float], torch.Tensor]  # x (..., C), eps → (..., C), no weight
RotaryFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # x (B, H, T, D), cos, sin (T, D/2)
# qkv (B, T, 3, nh, hs), cos, sin (T, hs/2), eps → q, k (QK-normed, rotated), v, each (B, nh, T, hs)
QkvHeadsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _TokenCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy whose backward uses that the loss's gradient w.r.t. log-probabilities is one-hot.

    Forward is torch's own log_softmax and gather, so the losses are F.cross_entropy's bits. Backward writes
    dlogits = (exp(logp) - onehot) * dloss in one pass over (N, V), where autograd through F.cross_entropy would
    zero-fill an (N, V) gradient, scatter into it and reduce it again in log_softmax's backward (~10 ms a step less
    on ANDREA-12M's (1024, 8192) logits on one CPU thread).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(logits, dim=1)  # (N, V)
        ctx.save_for_backward(logp, targets)
        return -logp.gather(1, targets[:, None]).squeeze(1)  # (N,)

    @staticmethod
    def backward(ctx, dloss: torch.Tensor) -> tuple[torch.Tensor, None]:
        logp, targets = ctx.saved_tensors
        dloss = dloss[:, None]  # (N, 1)
        dlogits = torch.exp(logp).mul_(dloss)  # (N, V)
        index = targets[:, None]
        # gather and scatter (not scatter_add_): one writer per element, deterministic on every device
        return dlogits.scatter_(1, index, dlogits.gather(1, index) - dloss), None


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (N, V), targets (N,) → per-token losses (N,) fp32 (an fp32 copy of half-precision logits)."""
    return _TokenCrossEntropy.apply(logits.float(), targets)


class ModelMath(NamedTuple):
    """Where the model's math comes from: torch (the defaults) or the Triton kernels (--kernels triton).
    The choice never changes the parameters, their order or the checkpoint. `rms_norm` and `qkv_heads` (QK-norm
    and rotary) serve the modern model (andrea/model/modern.py; torch's: andrea/model/torch_math.py); the GPT has
    neither."""

    attention: AttentionFn = sdpa_attention
    layer_norm: LayerNormFn | None = None  # None: torch's LayerNorm
    token_loss: TokenLossFn = token_cross_entropy
    rms_norm: RmsNormFn = rms_norm
    qkv_heads: QkvHeadsFn = qkv_heads


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters, same names) whose math can come from a fused kernel."""

    def __init__(self, ndim: int, bias: bool, fn: LayerNormFn | None = None):
        super().__init__(ndim, bias=bias)
        self.fn = fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.fn is None else self.fn(x, self.weight, self.bias, self.eps)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionFn):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.attention(q, k, v)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, attention: AttentionFn, layer_norm: LayerNormFn | None):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd, cfg.bias, layer_norm)
        self.attn = CausalSelfAttention(cfg, attention)
        self.ln_2 = LayerNorm(cfg.n_embd, cfg.bias, layer_norm)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _embedding(n: int, dim: int) -> nn.Embedding:
    """nn.Embedding(n, dim); on the meta device (the trainer's and layout_for's builds) without its normal_ init,
    which has no values to fill there: normal_ on a meta tensor runs a torch._refs function whose first call imports
    torch._dynamo, 1.5 s of CPU in every process that builds a model. Elsewhere, torch's init as ever."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding(n, dim, _weight=torch.empty(n, dim))
    return nn.Embedding(n, dim)


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: ModelMath = ModelMath()):
        super().__init__()
        if cfg.arch != "gpt2":
            raise ValueError(f"GPT needs model.arch=gpt2, not {cfg.arch!r} (andrea/model/arch.py builds either)")
        self.cfg = cfg
        self.token_loss = ops.token_loss
        # Registration order below IS the checkpoint's parameter order; do not reorder.
        self.wte = _embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = _embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg, ops.attention, ops.layer_norm) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd, cfg.bias, ops.layer_norm)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Activation checkpointing (train.activation_checkpointing = "blocks", set by the trainer): a block keeps
        # only its input (B, T, C) and runs its forward again in the backward. Non-reentrant torch.utils.checkpoint
        # holds back every tensor saved inside the block, the Triton kernels' save_for_backward included, and
        # replays the RNG state (dropout) and autocast, so the recomputation gives the same bytes.
        self.checkpoint_blocks = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """idx (B, T) → logits (B, T, V) and, with targets, the per-sequence mean loss (B,)."""
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        recompute = self.checkpoint_blocks and torch.is_grad_enabled()
        for block in self.h:
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        if targets is None:
            return logits, None
        # fp32 losses even under autocast; per-sequence means feed the data bandit at no extra cost.
        token_loss = self.token_loss(logits.view(-1, logits.size(-1)), targets.reshape(-1))  # (B·T,)
        return logits, token_loss.view(B, T).mean(dim=1)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter's place in the flat buffer (and so in the checkpoint's weights region)."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def decay(self) -> bool:
        """Weight decay on matrices only (not on biases, LayerNorm gains), as GPT-2/nanoGPT."""
        return len(self.shape) >= 2


def param_layout(model: nn.Module) -> list[ParamSpec]:
    layout, offset = [], 0
    for name, p in model.named_parameters():
        layout.append(ParamSpec(name, tuple(p.shape), offset, p.numel()))
        offset += p.numel()
    return layout


def layout_for(cfg: ModelConfig) -> list[ParamSpec]:
    """The GPT's layout of a configuration without allocating it (a 120M model costs nothing here); either arch's:
    andrea/model/arch.py."""
    with torch.device("meta"):
        return param_layout(GPT(cfg))


def n_params(layout: list[ParamSpec]) -> int:
    return layout[-1].offset + layout[-1].numel


def bind_flat(model: nn.Module, weights: torch.Tensor, grads: torch.Tensor) -> None:
    """Make every parameter a view into `weights` and its .grad a view into `grads` (both flat, same length).

    Autograd accumulates into an existing .grad in place, so after backward the flat gradient is complete;
    zero it with `grads.zero_()`, never by setting .grad to None.
    """
    for spec in param_layout(model):
        module_name, _, attr = spec.name.rpartition(".")
        module = model.get_submodule(module_name)
        view = weights[spec.offset:spec.offset + spec.numel].view(spec.shape)
        param = nn.Parameter(view)
        param.grad = grads[spec.offset:spec.offset + spec.numel].view(spec.shape)
        setattr(module, attr, param)


def init_weights(layout: list[ParamSpec], cfg: ModelConfig, seed: int) -> torch.Tensor:
    """Deterministic GPT-2 initialisation of the flat weights, on CPU, so every device starts from the same bytes.

    Matrices and embeddings ~ N(0, 0.02); the residual projections (attn.c_proj, mlp.c_proj) are scaled by
    1/sqrt(2·n_layer) so the residual stream's variance does not grow with depth (GPT-2 paper); biases 0,
    LayerNorm gains 1.
    """
    gen = torch.Generator().manual_seed(seed)
    flat = torch.empty(n_params(layout), dtype=torch.float32)
    for spec in layout:
        view = flat[spec.offset:spec.offset + spec.numel]
        if spec.name.endswith(".bias"):
            view.zero_()
        elif ".ln_" in f".{spec.name}":  # LayerNorm gain: ln_1, ln_2, ln_f
            view.fill_(1.0)
        else:
            std = 0.02 / math.sqrt(2 * cfg.n_layer) if spec.name.endswith("c_proj.weight") else 0.02
            view.normal_(0.0, std, generator=gen)
    return flat


def decay_mask(layout: list[ParamSpec], device: torch.device | str = "cpu") -> torch.Tensor:
    mask = torch.zeros(n_params(layout), dtype=torch.bool)
    for spec in layout:
        if spec.decay:
            mask[spec.offset:spec.offset + spec.numel] = True
    return mask.to(device)
