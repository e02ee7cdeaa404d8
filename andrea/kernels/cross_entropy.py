"""Cross-entropy over the vocabulary: the plain-torch reference and a fused Triton kernel beside it.

logits (N, V) in any float dtype, targets (N,) int64 in [0, V) or `ignore_index` → the mean loss over the rows not
ignored, a 0-d fp32 tensor (exactly F.cross_entropy's contract; all rows ignored gives nan, as torch does).
The forward reads each logit row once (online logsumexp over BLOCK-wide chunks, fp32 math) and writes the per-row
loss and logsumexp, (N,) fp32 each; the backward rereads the logits and writes dlogits (N, V) in the logits' dtype:
(softmax - onehot) * dloss / n_valid. One program per row and the mean taken by a torch sum: no atomics,
deterministic, and the (N, V) fp32 softmax is never materialised.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


def cross_entropy_reference(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=ignore_index)


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
def _cross_entropy_bwd_kernel(LOGITS, TARGETS, LSE, GRAD_SCALE, DLOGITS, V, stride_row, stride_drow, ignore_index,
                              BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(TARGETS + row)
    lse = tl.load(LSE + row)
    # dloss / n_valid, read on the device (no host sync); ignored rows get an all-zero gradient.
    scale = tl.where(target != ignore_index, tl.load(GRAD_SCALE), 0.0)
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


def _check_inputs(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or targets.shape != logits.shape[:1] or targets.dtype != torch.int64:
        raise ValueError(f"want logits (N, V) and int64 targets (N,); got {logits.shape}, {targets.shape} "
                         f"{targets.dtype}")
    if logits.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)")


def cross_entropy_forward(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100):
    """Returns (loss 0-d fp32, lse (N,) fp32, n_valid 0-d fp32)."""
    _check_inputs(logits, targets)
    logits, targets = logits.contiguous(), targets.contiguous()
    N, V = logits.shape
    loss_rows = torch.empty(N, device=logits.device, dtype=torch.float32)
    lse = torch.empty(N, device=logits.device, dtype=torch.float32)
    block, num_warps = cross_entropy_block(V, logits.device.type)
    _cross_entropy_fwd_kernel[(N,)](logits, targets, loss_rows, lse, V, logits.stride(0), ignore_index,
                                    BLOCK=block, num_warps=num_warps)
    n_valid = (targets != ignore_index).sum().float()
    return loss_rows.sum() / n_valid, lse, n_valid  # torch's sum: a fixed reduction order, deterministic


def cross_entropy_backward(dloss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor,
                           n_valid: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    logits, targets = logits.contiguous(), targets.contiguous()
    N, V = logits.shape
    dlogits = torch.empty_like(logits)
    grad_scale = (dloss.float() / n_valid).reshape(1)  # 0-d → 1 element: read by pointer in the kernel
    block, num_warps = cross_entropy_block(V, logits.device.type)
    _cross_entropy_bwd_kernel[(N,)](logits, targets, lse, grad_scale, dlogits, V, logits.stride(0),
                                    dlogits.stride(0), ignore_index, BLOCK=block, num_warps=num_warps)
    return dlogits


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index: int):
        loss, lse, n_valid = cross_entropy_forward(logits, targets, ignore_index)
        ctx.save_for_backward(logits, targets, lse, n_valid)
        ctx.ignore_index = ignore_index
        return loss

    @staticmethod
    def backward(ctx, dloss):
        logits, targets, lse, n_valid = ctx.saved_tensors
        return cross_entropy_backward(dloss, logits, targets, lse, n_valid, ctx.ignore_index), None, None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Fused F.cross_entropy(logits, targets, ignore_index=...) with mean reduction; logits (N, V), targets (N,)."""
    return CrossEntropyFunction.apply(logits, targets, ignore_index)
