"""Text generation: a batch of prompts decoded together through a KV cache, beside the training forward.

Why a KV cache on the training thread, rather than generating from a checkpoint's snapshot on another thread:
the audit's cost was the number and size of its forwards (len(prompts) x max_new_tokens, each over the whole
context), not where they ran. Batched and cached, an audit is one prefill of the prompts plus max_new_tokens - 1
one-token forwards for all prompts at once. For ANDREA-12M's audit (2 prompts x 48 tokens) that is 1/25 of the
arithmetic and half the weight reads (48 passes over ~40 MB of matrices instead of 96). On a CPU a one-token
forward is bound by reading those weights: with `_linear`'s layout and one thread (`_one_cpu_thread`) the audit
took 0.19 s in process on the 2-core machine against 1.39 s for the old loop (bench/audit.py). On a GPU, where
generation is latency-bound, the sequential forwards drop from len(prompts) x max_new_tokens to max_new_tokens.
It runs at a step boundary, reads the live weights (no second copy: 4·n bytes, 0.5 GB for ANDREA-120M) and takes
no cores or GPU time from a concurrent step; a generator on another thread would compete with training for the
same cores (CPU) or device, and would need the snapshot (taken only at checkpoints) or a copy of the weights at
every audit.

The training forward (`GPT.forward`) is untouched: training and evaluation run the same code as before, so no
checkpoint byte depends on this module. `forward_cached` walks the same modules and parameters (embeddings, each
block's LayerNorms, c_attn, c_proj and MLP, ln_f, lm_head): the LayerNorms are called as they are, so under
`--kernels triton` the Triton LayerNorm runs here too; the linear layers go through `_linear` (the same product
in the weight-streaming order, see there) and attention through torch's SDPA with an explicit mask over the
cached keys. The Triton attention kernel is causal-only over a square (T x T) block, built for training; a
one-token query against a cache needs a mask, and audits do not need a kernel for it. Under bf16 autocast (CUDA)
the matmuls run in bf16 as F.linear's do, and the cache holds keys and values in the dtype c_attn produced. The
model must be in eval mode (dropout off), as for any generation.

Unequal prompts are left-padded: in a batch whose longest row has W tokens, row r gets pad[r] = W - len(r)
padding slots in front, and slot j of row r holds the token at position j - pad[r]. Padding slots are masked out
of every row's keys (their own, unused outputs attend to themselves, so no softmax row is empty). Each new token
takes the next slot in every row, at position = that row's length, so one forward serves the whole batch.

The modern model (andrea/model/modern.py) runs the same loop through `_modern_blocks`: RMSNorms, q/k/v/o, QK-norm,
rotary at each slot's position (the tables gathered per row, so left padding shifts them as it shifts the GPT's
positions), SwiGLU or ReLU², and the model's own extras (embedding norm, q/k scale, logit softcap; value
embeddings, residual lambdas and backout per slot; smear from the cache's last embedding, none at a row's position 0).

Past block_size: positions are learned and absolute (rotary tables stop at block_size), and the uncached loop
feeds the last block_size tokens at positions 0..block_size-1; once a row is longer than that, every token's
position shifts with each new token and no cached key stays valid. So when the next token would make the longest
row exceed block_size, the batch is re-prefilled from each row's last block_size tokens (shorter rows are
re-prefilled unchanged, at the same positions): exactly the uncached loop's context, at its cost (one full-window
forward per token) from then on.
Audits (ANDREA-12M: a few prompt tokens + 48 new, block_size 256) never get there.

Equality with the uncached loop (`decode_uncached`, kept as the reference for tests and bench/audit.py): the same
math in a different summation order (matmuls as W @ x^T over B·t rows, a softmax over masked key sets), so the
logits agree to float rounding, not bit for bit (tests/e2e/test_generation.py bounds the gap against fp64). Sampling
(`sampler`): row r draws only from generators[r], so a prompt's draws do not depend on its batch-mates; its
logits can differ from a batch of one by rounding only, so its text matches too unless a uniform draw lands
within rounding of a boundary of the cumulative distribution (~1e-7 per token). A fixed seed and batch reproduce
the same bits on a given machine (on CPU the decode always runs on one thread, whatever the core count).

Reads and writes nothing on disk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

from andrea.errors import UserError
from andrea.model.gpt import GPT
from andrea.model.torch_math import qkv_heads
from andrea.model.modern import NORM_EPS, Modern, ReLU2, softcap

Pick = Callable[[torch.Tensor], list[int]]  # fp32 logits of each row's last token (B, V) → each row's next token


class KVCache:
    """Keys and values of every layer for one left-padded batch, with the position each slot's token has."""

    def __init__(self, widths: list[int], capacity: int, device: torch.device):
        width = max(widths)
        pad = torch.tensor([width - w for w in widths], device=device)  # (B,)
        slots = torch.arange(capacity, device=device)
        self.capacity = capacity
        self.valid = slots[None, :] >= pad[:, None]  # (B, capacity): a real token's slot (now or once written)
        self.pos = (slots[None, :] - pad[:, None]).clamp_(min=0)  # (B, capacity): its position
        self.k: torch.Tensor | None = None  # (L, B, nh, capacity, hs), allocated at the first write
        self.v: torch.Tensor | None = None
        self.used = 0  # slots written
        self.last: torch.Tensor | None = None  # (B, 1, C) the last written slot's embedding (model.smear's)


@torch.no_grad()
def forward_cached(model: GPT | Modern, cache: KVCache, idx: torch.Tensor) -> torch.Tensor:
    """Run tokens idx (B, t) through slots used..used+t of the cache → fp32 logits of the last slot (B, V)."""
    B, t = idx.shape
    s0, s1 = cache.used, cache.used + t
    if s1 > cache.capacity:
        raise ValueError(f"KV cache full: {s1} slots needed, {cache.capacity} allocated")
    q_slot = torch.arange(s0, s1, device=idx.device)[:, None]  # (t, 1)
    k_slot = torch.arange(s1, device=idx.device)[None, :]  # (1, s1)
    mask = (k_slot <= q_slot) & (cache.valid[:, None, :s1] | (k_slot == q_slot))  # (B, t, s1) causal, no padding
    mask = mask[:, None]  # (B, 1, t, s1): the same for every head

    def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer i: k, v (B, nh, t, hs) into the cache; q's attention over the cached keys → (B, t, C)."""
        if cache.k is None:
            shape = (len(model.h), B, k.size(1), cache.capacity, k.size(3))
            cache.k = torch.empty(shape, dtype=k.dtype, device=k.device)
            cache.v = torch.empty(shape, dtype=v.dtype, device=v.device)
        cache.k[i, :, :, s0:s1] = k
        cache.v[i, :, :, s0:s1] = v
        y = F.scaled_dot_product_attention(q, cache.k[i, :, :, :s1], cache.v[i, :, :, :s1], attn_mask=mask)
        return y.transpose(1, 2).reshape(B, t, -1)

    if isinstance(model, Modern):
        logits = _modern_blocks(model, cache.pos[:, s0:s1], idx, attend, cache)
    else:
        logits = _gpt_blocks(model, cache.pos[:, s0:s1], idx, attend)
    cache.used = s1
    return logits


def _gpt_blocks(model: GPT, pos: torch.Tensor, idx: torch.Tensor, attend) -> torch.Tensor:
    """The GPT's forward over idx (B, t) at positions pos (B, t) → fp32 logits of the last slot (B, V)."""
    B, t = idx.shape
    C, nh = model.cfg.n_embd, model.cfg.n_head
    x = model.wte(idx) + model.wpe(pos)  # (B, t, C)
    for i, block in enumerate(model.h):
        q, k, v = _linear(block.attn.c_attn, block.ln_1(x)).split(C, dim=2)
        q, k, v = (z.view(B, t, nh, C // nh).transpose(1, 2) for z in (q, k, v))  # (B, nh, t, hs)
        x = x + _linear(block.attn.c_proj, attend(i, q, k, v))  # resid_dropout: identity in eval
        mlp = block.mlp  # MLP.forward's math (dropout: identity in eval), through _linear
        x = x + _linear(mlp.c_proj, F.gelu(_linear(mlp.c_fc, block.ln_2(x)), approximate="tanh"))
    return _linear(model.lm_head, model.ln_f(x[:, -1])).float()  # (B, V)


def _modern_blocks(model: Modern, pos: torch.Tensor, idx: torch.Tensor, attend, cache: KVCache) -> torch.Tensor:
    """Modern.forward's math over idx (B, t) at positions pos (B, t) → fp32 logits of the last slot (B, V). Rotary
    takes each row's own positions (left padding shifts them), so QK-norm and rotary are torch's here
    (andrea/model/torch_math.py), with the tables gathered per row; the block norms are the model's (the Triton
    RMSNorm under --kernels triton)."""
    B, t = idx.shape
    C, nh = model.cfg.n_embd, model.cfg.n_head
    cos, sin = (tab[pos] for tab in model.rotary_tables(idx.device))  # (B, t, hs/2): each row's positions
    e = model.embed(idx)  # (B, t, C)
    prev = torch.zeros_like(e[:, :1]) if cache.last is None else cache.last
    x = x0 = model.smeared(e, prev, pos == 0)
    cache.last, middle = e[:, -1:], None
    for i, block in enumerate(model.h):
        x = model.mixed(i, x, x0)
        attn, h = block.attn, block.norm_1(x)
        qkv = torch.stack([_linear(p, h) for p in (attn.q_proj, attn.k_proj, attn.v_proj)], dim=2)  # (B, t, 3, C)
        q, k, v = attn.heads(qkv_heads(qkv.view(B, t, 3, nh, C // nh), cos, sin, NORM_EPS))  # (B, nh, t, hs)
        x = x + _linear(attn.o_proj, attend(i, q, k, attn.mix_value(h, v, model.value_embed(i, idx))))
        mlp, h = block.mlp, block.norm_2(x)
        if isinstance(mlp, ReLU2):
            x = x + _linear(mlp.down_proj, F.relu(_linear(mlp.up_proj, h)).square())
        else:
            x = x + _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, h)) * _linear(mlp.up_proj, h))
        middle = x if i == model.cfg.n_layer // 2 else middle
    logits = _linear(model.lm_head, model.norm_f(model.backed_out(x, middle)[:, -1]))  # (B, V)
    c = model.cfg.logit_softcap
    return (logits if c == 0.0 else softcap(logits, c)).float()


def _linear(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) computed as (W @ x^T)^T: the same math in another order, for one-token decode, which is bound by
    reading the weights. On one CPU core, a pass over ANDREA-12M's matrices for 2 rows took 2.3 ms this way and
    5.5-6.4 ms through F.linear (x @ W^T), and 9.2 ms when x^T is a contiguous (in, N) tensor: rows stay
    row-major (N, in), so x^T is a transposed view."""
    rows = x.reshape(-1, x.size(-1)).contiguous()  # (N, in)
    if layer.bias is None:
        y = layer.weight @ rows.t()  # (out, N)
    else:
        y = torch.addmm(layer.bias[:, None], layer.weight, rows.t())  # under autocast: bf16, as F.linear
    return y.t().contiguous().view(*x.shape[:-1], -1)


def _prefill(model: GPT | Modern, window: list[list[int]], capacity: int) -> tuple[KVCache, torch.Tensor]:
    device = model.wte.weight.device
    cache = KVCache([len(r) for r in window], capacity, device)
    width = max(len(r) for r in window)
    idx = torch.tensor([[0] * (width - len(r)) + r for r in window], dtype=torch.long, device=device)  # (B, W)
    return cache, forward_cached(model, cache, idx)


def decode(model: GPT | Modern, prompts: list[list[int]], max_new_tokens: int, pick: Pick) -> list[list[int]]:
    """Extend every prompt by max_new_tokens tokens chosen by `pick`, all rows in one KV-cached batch."""
    if model.training:
        raise ValueError("generation needs the model in eval mode (dropout off)")
    if not prompts or not all(prompts):
        raise ValueError("generation needs at least one prompt, each of at least one token")
    block = model.cfg.block_size
    rows = [list(p) for p in prompts]
    cache: KVCache | None = None
    nxt: list[int] = []
    with _one_cpu_thread(model.wte.weight.device):
        for i in range(max_new_tokens):
            if cache is not None and cache.used < block:  # the longest row stays within block_size: one more slot
                logits = forward_cached(model, cache, torch.tensor(nxt, device=cache.pos.device)[:, None])
            else:  # the first prefill, or a re-prefill of the cropped window (see the module docstring)
                window = [r[-block:] for r in rows]
                capacity = min(block, max(len(r) for r in window) + max_new_tokens - 1 - i)
                cache, logits = _prefill(model, window, capacity)
            nxt = pick(logits)
            for r, token in zip(rows, nxt, strict=True):
                r.append(token)
    return [r[len(p):] for r, p in zip(rows, prompts)]


@contextmanager
def _one_cpu_thread(device: torch.device) -> Iterator[None]:
    """On CPU, decode with one intra-op thread, then restore the caller's count (training's summation order).

    A decode forward is ~150 small ops (B x 1 rows); with two OpenMP threads each op ends in a barrier, and on a
    machine with any other load a barrier waits for a descheduled thread: measured on the shared 2-core machine
    (before `_linear`), one ANDREA-12M audit took 5.7-18.8 s on 2 threads against 0.5-1.0 s on 1. On the idle
    machine the second thread saves a quarter (0.14 s against 0.19 s, both under 0.05 of a 4 s step): a small
    price for an audit that stays cheap on a busy one. It also makes CPU audit text independent of the core
    count. Only the training thread runs torch at a step boundary, OpenMP's and MKL's counts are per calling
    thread, and the count is back before the next step.
    """
    if device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def decode_uncached(model: GPT | Modern, prompts: list[list[int]], max_new_tokens: int, pick: Pick) -> list[list[int]]:
    """The reference loop: per new token, a full forward of each row's last block_size tokens, row by row."""
    block = model.cfg.block_size
    device = model.wte.weight.device
    rows = [list(p) for p in prompts]
    for _ in range(max_new_tokens):
        logits = torch.stack([model(torch.tensor([r[-block:]], dtype=torch.long, device=device))[0][0, -1].float()
                              for r in rows])  # (B, V)
        for r, token in zip(rows, pick(logits), strict=True):
            r.append(token)
    return [r[len(p):] for r, p in zip(rows, prompts)]


class DivergedModel(UserError, ValueError):
    """A model whose logits are not finite (weights grown past float range, or NaN): nothing can be sampled."""


def sampler(temperature: float, top_k: int, generators: list[torch.Generator]) -> Pick:
    """Temperature and top-k sampling; row r draws from generators[r] (CPU) only, one multinomial per token.

    With top_k, the draw is over the k largest logits alone (softmax of those k, then their index): the same
    distribution as masking the others to -inf, at 1/V of the random numbers and host copy (ties at the k-th
    logit are broken by torch.topk, where a mask would keep them all)."""
    def pick(logits: torch.Tensor) -> list[int]:
        if logits.size(0) != len(generators):
            raise ValueError(f"{logits.size(0)} rows but {len(generators)} generators")
        logits = logits / max(temperature, 1e-5)  # (B, V)
        if top_k:
            logits, index = torch.topk(logits, min(top_k, logits.size(-1)), dim=-1)  # (B, k) each
            index = index.cpu()
        probs = torch.softmax(logits, dim=-1).cpu()  # one device-to-host copy per token for the whole batch
        if not bool(torch.isfinite(probs).all()):  # an inf or NaN logit: no distribution to draw from
            raise DivergedModel("the model's next-token logits are not finite: its weights have diverged")
        drawn = [int(torch.multinomial(p, 1, generator=g)) for p, g in zip(probs, generators)]
        return [int(index[r, d]) for r, d in enumerate(drawn)] if top_k else drawn
    return pick
