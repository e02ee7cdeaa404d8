"""Cross-entropy over the vocabulary: the plain-torch reference and a fused Triton kernel beside it.

logits (N, V) in any float dtype, targets (N,) int64 in [0, V) or `ignore_index`. Reductions as F.cross_entropy:
"none" → the per-row losses (N,) fp32, 0 on ignored rows (the trainer's choice: per-sequence losses feed the data
bandit); "mean" → their mean over the rows not ignored (all rows ignored gives nan, as torch does); "sum".
The forward reads each logit row once (online logsumexp over BLOCK-wide chunks, fp32 math) and writes the per-row
loss and logsumexp, (N,) fp32 each; the backward rereads the logits and writes dlogits (N, V) in the logits' dtype:
(softmax - onehot) * dloss[row]. One program per row, the reductions are torch sums over (N,): no atomics,
deterministic, and neither an fp32 copy of bf16 logits nor the (N, V) softmax is ever materialised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from andrea.kernels.launch import FP_FUSION

REDUCTIONS = ("none", "mean", "sum")


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                            reduction: str = "mean") -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index, reduction=reduction)


@triton.jit
def _cross_entropy_fwd_kernel(LOGITS, TARGETS, LOSS, LSE, V, stride_row, ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: N * V passes 2**31 for long batches over a 50k vocabulary
    base = LOGITS + row * stride_row
    offs = tl.arange(0, BLOCK)
    m = float("-inf")  # running max
    s = 0.0  # running sum of exp(x - m)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)  # (BLOCK,)
        m_new = tl.maximum(m, tl.max(x, 0))  # finite: every chunk holds at least one real column
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(TARGETS + row)
    valid = target != ignore_index
    x_target = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
    tl.store(LOSS + row, tl.where(valid, lse - x_target, 0.0))
    tl.store(LSE + row, lse)


@triton.jit
def _cross_entropy_bwd_kernel(LOGITS, TARGETS, LSE, DLOSS, DLOGITS, V, stride_row, stride_drow, stride_dloss,
                              ignore_index, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGETS + row)
    lse = tl.load(LSE + row)
    # dloss[row] read on the device (no host sync; stride 0 when a mean broadcast it); ignored rows get zeros.
    scale = tl.where(target != ignore_index, tl.load(DLOSS + row * stride_dloss).to(tl.float32), 0.0)
    offs = tl.arange(0, BLOCK)
    for start in range(0, V, BLOCK):
        cols = start + offs
        x = tl.load(LOGITS + row * stride_row + cols, mask=cols < V, other=0.0).to(tl.float32)  # (BLOCK,)
        p = tl.exp(x - lse)
        p = tl.where(cols == target, p - 1.0, p)
        tl.store(DLOGITS + row * stride_drow + cols, (p * scale).to(DLOGITS.dtype.element_ty), mask=cols < V)


def cross_entropy_block(vocab_size: int, device_type: str) -> tuple[int, int]:
    """(BLOCK, num_warps), pinned per vocabulary size. GPU: up to 4096 columns per chunk (16 fp32 per thread at 8
    warps) so a 50k vocabulary takes ~13 chunks. Interpreter: chunks of at most 1024, so tests with V > 1024 still
    cross chunk boundaries."""
    cap = 1024 if device_type == "cpu" else 4096
    block = min(cap, triton.next_power_of_2(max(vocab_size, 16)))
    return block, (8 if block >= 2048 else 4)


def _check_inputs(logits: torch.Tensor, targets: torch.Tensor, reduction: str) -> None:
    if logits.dim() != 2 or targets.shape != logits.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"want logits (N, V) and int64 targets (N,); got {logits.shape}, {targets.shape} "
                         f"{targets.dtype}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if logits.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)")


def cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (loss, lse), (N,) fp32 each; loss is 0 on ignored rows."""
    N, V = logits.shape
    loss = torch.empty(N, device=logits.device, dtype=torch.float32)
    lse = torch.empty(N, device=logits.device, dtype=torch.float32)
    block, num_warps = cross_entropy_block(V, logits.device.type)
    _cross_entropy_fwd_kernel[(N,)](logits, targets, loss, lse, V, logits.stride(0), ignore_index,
                                    BLOCK=block, num_warps=num_warps, enable_fp_fusion=FP_FUSION)
    return loss, lse


def cross_entropy_backward(dloss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                           ignore_index: int = -100) -> torch.Tensor:
    """dlogits (N, V) in the logits' dtype for the per-row upstream gradient dloss (N,) (any stride)."""
    N, V = logits.shape
    dlogits = torch.empty_like(logits)
    block, num_warps = cross_entropy_block(V, logits.device.type)
    _cross_entropy_bwd_kernel[(N,)](logits, targets, lse, dloss, dlogits, V, logits.stride(0), dlogits.stride(0),
                                    dloss.stride(0), ignore_index, BLOCK=block, num_warps=num_warps,
                                    enable_fp_fusion=FP_FUSION)
    return dlogits


class CrossEntropyFunction(torch.autograd.Function):
    """Per-row losses (N,) fp32; the reductions are plain torch on top, so autograd hands back dloss (N,)."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int):
        loss, lse = cross_entropy_forward(logits, targets, ignore_index)
        ctx.save_for_backward(logits, targets, lse)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, targets, lse = ctx.saved_tensors
        return cross_entropy_backward(dloss, logits, targets, lse, ctx.ignore_index), None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """Fused F.cross_entropy(logits, targets, ignore_index=..., reduction=...); logits (N, V), targets (N,).

    The loss is fp32 whatever the logits' dtype (bf16 logits are read as they are, never copied to fp32)."""
    _check_inputs(logits, targets, reduction)
    rows = CrossEntropyFunction.apply(logits.contiguous(), targets.contiguous(), ignore_index)  # (N,) fp32
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    # torch's sums over (N,): a fixed reduction order, deterministic; the count stays on the device (no sync).
    return rows.sum() / (targets != ignore_index).sum()
