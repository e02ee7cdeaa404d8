"""Causal self-attention: the plain-torch reference and the fused Triton kernel (FlashAttention-2) beside it.

q, k, v: (B, H, T, D) → (B, H, T, D). The reference materialises the (T, T) score matrix in the input dtype;
it is the ground truth the kernel is tested against and the readable definition of the op.
The kernel reads q, k, v and writes o plus an fp32 logsumexp (B, H, T) saved for the backward, which reads
q, k, v, o, dO, lse and writes dq, dk, dv. T >= 1 (ragged tails masked), D in 16/32/64/128; fp16/bf16 on the GPU,
fp32 anywhere (CPU tensors run under TRITON_INTERPRET=1). Deterministic: no atomics, no autotuning.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from andrea.kernels.launch import FP_FUSION


def attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                        scale: float | None = None) -> torch.Tensor:
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (q @ k.transpose(-2, -1)) * scale  # (B, H, T, T)
    if causal:
        T, S = q.shape[-2], k.shape[-2]
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v  # (B, H, T, D)


# ----------------------------------------------------------------------------------------------------------------
# Fused kernel (FlashAttention-2). The forward never materialises the (T, T) scores: each program owns BLOCK_M query
# rows of one (batch, head), streams K/V blocks through an online softmax and saves the row logsumexp. The backward
# recomputes the probabilities from that logsumexp in two passes with exactly one writer per output tile — a dK/dV
# pass over key blocks and a dQ pass over query blocks — so it needs no atomics and is bit-for-bit deterministic.
# Tensors are made contiguous by the launchers, so one (batch, head) is a dense (T, D) slab at offset bh * T * D.
# Scores are kept in log2 units (scale * log2(e) folded into one multiply) so the kernels use exp2; log2(e) appears
# as a literal inside the kernels because a jitted function cannot read a plain module-level float.

LOG2E = 1.4426950408889634
SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


@triton.jit
def _attn_fwd_kernel(Q, K, V, O, LSE, T, qk_scale, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64: B * H * T * D can pass 2**31 at long context
    slab = bh * T * HEAD_DIM
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < T
    q = tl.load(Q + slab + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # (M, D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running row max (log2 units)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running row sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Causal: key blocks entirely above the diagonal of this query block contribute nothing and are skipped.
    hi = tl.minimum((pid_m + 1) * BLOCK_M, T) if CAUSAL else T
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_off = slab + cols[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + kv_off, mask=cols[:, None] < T, other=0.0)  # (N, D)
        v = tl.load(V + kv_off, mask=cols[:, None] < T, other=0.0)  # (N, D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N)
        keep = cols[None, :] < T
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        s = tl.where(keep, s, float("-inf"))
        # Key 0 is visible to every row (even padded ones), so m_new is finite from the first block on.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # rescales what was accumulated under the old max; 0 on the first block
        p = tl.exp2(s - m_new[:, None])  # (M, N)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    acc = acc / l_i[:, None]
    tl.store(O + slab + rows[:, None] * HEAD_DIM + offs_d[None, :], acc.to(O.dtype.element_ty), mask=row_ok[:, None])
    # Natural-log logsumexp of the scaled scores: the backward recomputes p = exp(s - lse) from it.
    tl.store(LSE + bh * T + rows, (m_i + tl.log2(l_i)) / 1.4426950408889634, mask=row_ok)  # / log2(e)


@triton.jit
def _attn_bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, T, sm_scale, qk_scale, CAUSAL: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                          DOT_PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    slab = bh * T * HEAD_DIM
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # the key rows this program owns
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    col_ok = cols < T
    kv_off = slab + cols[:, None] * HEAD_DIM + offs_d[None, :]
    k = tl.load(K + kv_off, mask=col_ok[:, None], other=0.0)  # (N, D)
    v = tl.load(V + kv_off, mask=col_ok[:, None], other=0.0)  # (N, D)
    dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    # Causal: query blocks wholly before this key block never see it; start at the first one that may.
    lo = (pid_n * BLOCK_N // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for start_m in range(lo, T, BLOCK_M):
        rows = start_m + offs_m
        row_ok = rows < T
        q_off = slab + rows[:, None] * HEAD_DIM + offs_d[None, :]
        q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)  # (M, D)
        do = tl.load(DO + q_off, mask=row_ok[:, None], other=0.0)  # (M, D)
        lse2 = tl.load(LSE + bh * T + rows, mask=row_ok, other=0.0) * 1.4426950408889634  # (M,) log2 units
        delta = tl.load(DELTA + bh * T + rows, mask=row_ok, other=0.0)  # (M,) rowsum(dO * O)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # (N, M): scores transposed
        keep = col_ok[:, None] & row_ok[None, :]
        if CAUSAL:
            keep = keep & (rows[None, :] >= cols[:, None])
        p_t = tl.where(keep, tl.exp2(s_t - lse2[None, :]), 0.0)  # where, not multiply: masked exp2 may be inf
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)  # (N, M)
        ds_t = p_t * (dp_t - delta[None, :])  # softmax backward: dS = P * (dP - rowsum(dO * O))
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=DOT_PRECISION)
    tl.store(DK + kv_off, (dk * sm_scale).to(DK.dtype.element_ty), mask=col_ok[:, None])
    tl.store(DV + kv_off, dv.to(DV.dtype.element_ty), mask=col_ok[:, None])


@triton.jit
def _attn_bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, T, sm_scale, qk_scale, CAUSAL: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)
    slab = bh * T * HEAD_DIM
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    row_ok = rows < T
    q_off = slab + rows[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(Q + q_off, mask=row_ok[:, None], other=0.0)  # (M, D)
    do = tl.load(DO + q_off, mask=row_ok[:, None], other=0.0)  # (M, D)
    lse2 = tl.load(LSE + bh * T + rows, mask=row_ok, other=0.0) * 1.4426950408889634  # (M,)
    delta = tl.load(DELTA + bh * T + rows, mask=row_ok, other=0.0)  # (M,)
    dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    hi = tl.minimum((pid_m + 1) * BLOCK_M, T) if CAUSAL else T
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + offs_n
        kv_off = slab + cols[:, None] * HEAD_DIM + offs_d[None, :]
        k = tl.load(K + kv_off, mask=cols[:, None] < T, other=0.0)  # (N, D)
        v = tl.load(V + kv_off, mask=cols[:, None] < T, other=0.0)  # (N, D)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (M, N)
        keep = row_ok[:, None] & (cols[None, :] < T)
        if CAUSAL:
            keep = keep & (cols[None, :] <= rows[:, None])
        p = tl.where(keep, tl.exp2(s - lse2[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)  # (M, N)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)
    tl.store(DQ + q_off, (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_ok[:, None])


class AttentionConfig(NamedTuple):
    """One pinned launch shape per kernel: (block_m, block_n) tiles plus warps and pipeline stages."""
    fwd: tuple[int, int]
    dkdv: tuple[int, int]
    dq: tuple[int, int]
    num_warps: int
    num_stages: int


def attention_config(head_dim: int, dtype: torch.dtype, device_type: str) -> AttentionConfig:
    """The launch shape for a (head_dim, dtype, device) class. Fixed, never autotuned: same config, same bits.

    Under the interpreter (CPU tensors) tiles are 16 wide: per-block cost is Python overhead, and small tiles make
    T = 7 / 65 / 129 exercise ragged tails and several causal blocks. On the GPU the shapes follow the Triton
    fused-attention tutorial for Hopper: wide query tiles forward; the backward passes put the wide side on the
    block they own (keys for dK/dV, queries for dQ) and stream narrow tiles of the other side.
    """
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} not in {SUPPORTED_HEAD_DIMS}")
    if device_type == "cpu":
        return AttentionConfig(fwd=(16, 16), dkdv=(16, 16), dq=(16, 16), num_warps=1, num_stages=1)
    wide = 128 if dtype != torch.float32 else 64  # fp32 tiles take twice the shared memory
    if head_dim == 128:
        return AttentionConfig(fwd=(wide, 64), dkdv=(32, wide), dq=(wide, 32), num_warps=8, num_stages=2)
    return AttentionConfig(fwd=(wide, 64), dkdv=(32, wide), dq=(wide, 32), num_warps=4, num_stages=3)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: full-precision dots ("tf32" would cost ~3 decimal digits); 16-bit inputs ignore this knob.
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must share one (B, H, T, D) shape; got {q.shape}, {k.shape}, {v.shape}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q, k, v must share a dtype among fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)")


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                      scale: float | None = None, config: AttentionConfig | None = None):
    """Returns (o, lse): o (B, H, T, D) in the input dtype, lse (B, H, T) fp32 natural-log logsumexp of the scores."""
    _check_inputs(q, k, v)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    B, H, T, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cfg = config or attention_config(D, q.dtype, q.device.type)
    o = torch.empty_like(q)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    block_m, block_n = cfg.fwd
    _attn_fwd_kernel[(triton.cdiv(T, block_m), B * H)](
        q, k, v, o, lse, T, scale * LOG2E, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=D,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        enable_fp_fusion=FP_FUSION)
    return o, lse


def attention_backward(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, causal: bool = True, scale: float | None = None,
                       config: AttentionConfig | None = None):
    """Returns (dq, dk, dv), each (B, H, T, D) in the input dtype, from dO and the forward's o and lse."""
    q, k, v, o, do = (t.contiguous() for t in (q, k, v, o, do))
    B, H, T, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    cfg = config or attention_config(D, q.dtype, q.device.type)
    # delta = rowsum(dO * O) (B, H, T): a plain fp32 torch reduction — O(T * D), fixed order, deterministic.
    delta = (do.float() * o.float()).sum(-1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    meta = dict(CAUSAL=causal, HEAD_DIM=D, DOT_PRECISION=_dot_precision(q.dtype), num_warps=cfg.num_warps,
                num_stages=cfg.num_stages, enable_fp_fusion=FP_FUSION)
    block_m, block_n = cfg.dkdv
    _attn_bwd_dkdv_kernel[(triton.cdiv(T, block_n), B * H)](
        q, k, v, do, lse, delta, dk, dv, T, scale, scale * LOG2E, BLOCK_M=block_m, BLOCK_N=block_n, **meta)
    block_m, block_n = cfg.dq
    _attn_bwd_dq_kernel[(triton.cdiv(T, block_m), B * H)](
        q, k, v, do, lse, delta, dq, T, scale, scale * LOG2E, BLOCK_M=block_m, BLOCK_N=block_n, **meta)
    return dq, dk, dv


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal: bool, scale: float | None, config: AttentionConfig | None):
        o, lse = attention_forward(q, k, v, causal, scale, config)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.causal, ctx.scale, ctx.config = causal, scale, config
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(do, q, k, v, o, lse, ctx.causal, ctx.scale, ctx.config)
        return dq, dk, dv, None, None, None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              scale: float | None = None, config: AttentionConfig | None = None) -> torch.Tensor:
    """Fused attention, (B, H, T, D) → (B, H, T, D); same contract as attention_reference (self-attention: the
    causal mask is the plain lower triangle). `config` overrides the pinned launch shape (tests only)."""
    return AttentionFunction.apply(q, k, v, causal, scale, config)
