"""Parameter-free RMSNorm over the last dim: the plain-torch reference and a fused Triton kernel beside it.

x (..., C) in any float dtype → y (..., C) in x's dtype, y = x * rsqrt(mean(x², -1) + eps), with no weight (the
modern GPT's norm on the residual stream and its QK-norm on each head's q and k, docs/architecture.md).
rms_norm_reference computes in fp32 whatever x's dtype and rounds once at the end: the ground truth the kernel is
held to (tests/unit/kernels/test_rmsnorm.py).
The kernel reads x once (fp32 math) and writes y plus each row's rstd, (N,) fp32; the backward rereads x and dy and
writes dx = rstd * (dy - x_hat * mean(dy * x_hat)) with x_hat = x * rstd, in x's dtype. Without a weight no sum runs
across rows, so each output has one writer: deterministic with no further care. C <= 4096 (one BLOCK, the next power
of 2 of C, holds a row, tail masked); each program takes ROWS rows at once, so QK-norm's short rows (C = head dim)
fill a program as the residual stream's long ones do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from andrea.kernels.launch import FP_FUSION

MAX_COLUMNS = 4096


def rms_norm_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()  # (..., C) fp32 math for every input dtype
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)  # (..., C) in x's dtype


@triton.jit
def _rms_norm_fwd_kernel(X, Y, RSTD, n_rows, C, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # int64: N * C passes 2**31 on long batches
    cols = tl.arange(0, BLOCK)
    ok = (rows < n_rows)[:, None] & (cols < C)[None, :]
    offs = rows[:, None] * C + cols[None, :]  # (ROWS, BLOCK): rows are contiguous, stride C
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    # Round-to-nearest sqrt and division: Triton's default fp32 sqrt and `/` are approximate on NVIDIA.
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(x * x, 1) / C + eps))  # (ROWS,)
    tl.store(Y + offs, (x * rstd[:, None]).to(Y.dtype.element_ty), mask=ok)
    tl.store(RSTD + rows, rstd, mask=rows < n_rows)


@triton.jit
def _rms_norm_bwd_kernel(X, DY, RSTD, DX, n_rows, C, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    ok = (rows < n_rows)[:, None] & (cols < C)[None, :]
    offs = rows[:, None] * C + cols[None, :]
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)  # (ROWS, BLOCK)
    dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=rows < n_rows, other=0.0)  # (ROWS,)
    x_hat = x * rstd[:, None]
    # the gradient through rstd: rstd³ x_j mean(dy x) = rstd x_hat_j mean(dy x_hat)
    c = tl.sum(dy * x_hat, 1) / C  # (ROWS,)
    dx = (dy - x_hat * c[:, None]) * rstd[:, None]
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=ok)


def rms_norm_config(n_cols: int, device_type: str) -> tuple[int, int, int]:
    """(BLOCK, ROWS, num_warps), pinned per row length and device type; never autotuned: same config, same bits.
    GPU: ~2048 elements a program (16 fp32 per thread at 4 warps; a 4096-wide row takes 8). Interpreter: ~512 (each
    program costs Python overhead), so the tests' 123 rows of 48 still span 16 programs with a ragged last one."""
    if not 1 <= n_cols <= MAX_COLUMNS:
        raise ValueError(f"RMS norm over {n_cols} columns; supported: 1 to {MAX_COLUMNS}")
    block = triton.next_power_of_2(n_cols)
    if device_type == "cpu":
        return block, max(1, 512 // block), 1
    return block, max(1, 2048 // block), 8 if block >= 4096 else 4


def _check_input(x: torch.Tensor) -> None:
    if x.dim() == 0 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"want x (..., C) in fp32/bf16/fp16; got {tuple(x.shape)} {x.dtype}")
    if x.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)")


def rms_norm_forward(x: torch.Tensor, eps: float = 1e-6):
    """Returns (y (..., C) in x's dtype, x2d (N, C) contiguous, rstd (N,) fp32)."""
    _check_input(x)
    C = x.shape[-1]
    block, rows, num_warps = rms_norm_config(C, x.device.type)
    x2d = x.contiguous().view(-1, C)  # (N, C): leading dims flattened, strided inputs (q, k per head) copied once
    N = x2d.shape[0]
    y = torch.empty_like(x2d)
    rstd = torch.empty(N, device=x.device, dtype=torch.float32)
    if N:
        _rms_norm_fwd_kernel[(triton.cdiv(N, rows),)](x2d, y, rstd, N, C, eps, ROWS=rows, BLOCK=block,
                                                       num_warps=num_warps, enable_fp_fusion=FP_FUSION)
    return y.view(x.shape), x2d, rstd


def rms_norm_backward(dy: torch.Tensor, x2d: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """Returns dx (N, C) in x's dtype."""
    N, C = x2d.shape
    dy = dy.contiguous().view(N, C)
    dx = torch.empty_like(x2d)
    block, rows, num_warps = rms_norm_config(C, x2d.device.type)
    if N:
        _rms_norm_bwd_kernel[(triton.cdiv(N, rows),)](x2d, dy, rstd, dx, N, C, ROWS=rows, BLOCK=block,
                                                       num_warps=num_warps, enable_fp_fusion=FP_FUSION)
    return dx


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps: float):
        y, x2d, rstd = rms_norm_forward(x, eps)
        ctx.save_for_backward(x2d, rstd)
        ctx.x_shape = x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, rstd = ctx.saved_tensors
        return rms_norm_backward(dy, x2d, rstd).view(ctx.x_shape), None


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Fused rms_norm_reference(x, eps) over the last dim of x (..., C)."""
    return RMSNormFunction.apply(x, eps)
