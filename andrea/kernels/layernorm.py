"""LayerNorm over the last dim: the plain-torch reference and a fused Triton kernel beside it.

x (..., C) in any float dtype, weight (C,) fp32, bias (C,) fp32 or None → y (..., C) in x's dtype, exactly
F.layer_norm(x, (C,), weight, bias, eps): biased variance, eps inside the square root. C <= 4096 (one BLOCK holds a
whole row, BLOCK = next power of 2 of C, tail masked); any number of rows.
The forward reads each row once (fp32 math) and writes y plus the row's mean and rstd, (N,) fp32 each. The backward
rereads x and dy and writes dx (N, C) in x's dtype; dweight and dbias (C,) fp32 are reduced in two deterministic
stages: each program sums dy * x_hat and dy over a fixed contiguous group of rows into its own row of a
(n_programs, C) fp32 buffer, and a torch .sum(0) adds the groups. The grouping is a pure function of the shape and
device type (never of SM count or timing) and there are no atomics, so two runs give the same bits.
layer_norm_reference is the same math in plain torch ops, in x's dtype: with an fp16/bf16 x the mean, variance and
rstd are rounded to that dtype at every step (the low-precision baseline the tests hold the kernel to), and y comes
back in x's dtype as from F.layer_norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from andrea.kernels.launch import FP_FUSION

MAX_COLUMNS = 4096  # one row per BLOCK: at 8 warps that is 16 fp32 per thread for each of x, dy, w


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         eps: float = 1e-5) -> torch.Tensor:
    mean = x.mean(-1, keepdim=True)  # (..., 1)
    var = (x - mean).pow(2).mean(-1, keepdim=True)  # (..., 1), biased: divides by C, as F.layer_norm
    y = (x - mean) * torch.rsqrt(var + eps) * weight  # (..., C); an fp32 weight promotes an fp16/bf16 x's y to fp32
    return (y if bias is None else y + bias).to(x.dtype)  # x's dtype, as F.layer_norm with mixed dtypes


@triton.jit
def _layer_norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, C, stride_x, stride_y, eps, HAS_BIAS: tl.constexpr,
                           BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: N * C passes 2**31 for long batches of wide rows
    cols = tl.arange(0, BLOCK)
    col_ok = cols < C
    x = tl.load(X + row * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)  # (BLOCK,)
    mean = tl.sum(x, 0) / C
    xc = tl.where(col_ok, x - mean, 0.0)  # two-pass variance: no E[x^2] - E[x]^2 cancellation
    var = tl.sum(xc * xc, 0) / C
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd * w
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=col_ok)
    tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)


@triton.jit
def _layer_norm_bwd_kernel(X, W, DY, MEAN, RSTD, DX, DW_PARTIAL, DB_PARTIAL, n_rows, C, rows_per_program, stride_x,
                           stride_dy, stride_dx, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    col_ok = cols < C
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)  # (BLOCK,)
    dw = tl.zeros([BLOCK], tl.float32)  # this group's sum of dy * x_hat
    db = tl.zeros([BLOCK], tl.float32)  # this group's sum of dy
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)  # the last group may be short
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=col_ok, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + row)
        rstd = tl.load(RSTD + row)
        x_hat = tl.where(col_ok, (x - mean) * rstd, 0.0)
        wdy = w * dy  # 0 on padded columns (w and dy load as 0 there)
        # dx = rstd * (w*dy - mean(w*dy) - x_hat * mean(w*dy * x_hat)): the gradient through mean and rstd
        c1 = tl.sum(x_hat * wdy, 0) / C
        c2 = tl.sum(wdy, 0) / C
        dx = (wdy - (x_hat * c1 + c2)) * rstd
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_ok)
        dw += dy * x_hat
        if HAS_BIAS:
            db += dy
    tl.store(DW_PARTIAL + pid * C + cols, dw, mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PARTIAL + pid * C + cols, db, mask=col_ok)


def layer_norm_config(n_rows: int, n_cols: int, device_type: str) -> tuple[int, int, int]:
    """(BLOCK, num_warps, rows_per_program), pinned per shape and device type; never autotuned: same config, same
    bits. rows_per_program is the backward's dW/dB group. Interpreter: 16 rows, so 130 rows make 9 groups with a
    ragged last one. GPU: at most 1024 groups (several waves on any current GPU, and a (1024, C) fp32 partial buffer
    of <= 16 MiB); it depends on the row count only, never on the SM count, so a checkpoint resumed on another GPU
    model reduces in the same order."""
    if not 1 <= n_cols <= MAX_COLUMNS:
        raise ValueError(f"layer norm over {n_cols} columns; supported: 1 to {MAX_COLUMNS}")
    block = triton.next_power_of_2(n_cols)
    num_warps = 8 if block >= 2048 else (4 if block >= 256 else 2)
    rows_per_program = 16 if device_type == "cpu" else max(1, triton.cdiv(n_rows, 1024))
    return block, num_warps, rows_per_program


def _check_inputs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    C = x.shape[-1] if x.dim() else 0
    if weight.shape != (C,) or (bias is not None and bias.shape != (C,)):
        raise ValueError(f"want x (..., C) with weight and bias (C,); got {tuple(x.shape)}, {tuple(weight.shape)}, "
                         f"{None if bias is None else tuple(bias.shape)}")
    for name, p in (("weight", weight), ("bias", bias)):
        # the kernels read W + cols: a strided or foreign parameter would be read wrongly, not rejected
        if p is not None and (not p.is_contiguous() or p.device != x.device or p.dtype != torch.float32):
            raise ValueError(f"{name} must be a contiguous fp32 tensor on {x.device}; got {p.dtype} on {p.device}"
                             f"{'' if p.is_contiguous() else ', strided'}")
    if x.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)")


def layer_norm_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5):
    """Returns (y (..., C) in x's dtype, x2d (N, C) contiguous, mean (N,) fp32, rstd (N,) fp32)."""
    _check_inputs(x, weight, bias)
    C = x.shape[-1]
    x2d = x.contiguous().view(-1, C)  # (N, C): leading dims flattened, strided inputs copied once
    N = x2d.shape[0]
    y = torch.empty_like(x2d)
    mean = torch.empty(N, device=x.device, dtype=torch.float32)
    rstd = torch.empty(N, device=x.device, dtype=torch.float32)
    block, num_warps, _ = layer_norm_config(N, C, x.device.type)
    if N:
        # Without a bias the kernel never reads B; weight stands in as a valid pointer.
        _layer_norm_fwd_kernel[(N,)](x2d, weight, weight if bias is None else bias, y, mean, rstd, C, x2d.stride(0),
                                     y.stride(0), eps, HAS_BIAS=bias is not None, BLOCK=block, num_warps=num_warps,
                                     enable_fp_fusion=FP_FUSION)
    return y.view(x.shape), x2d, mean, rstd


def layer_norm_backward(dy: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
                        rstd: torch.Tensor, has_bias: bool):
    """Returns (dx (N, C) in x's dtype, dweight (C,) fp32, dbias (C,) fp32 or None)."""
    N, C = x2d.shape
    dy = dy.contiguous().view(N, C)
    dx = torch.empty_like(x2d)
    block, num_warps, rows_per_program = layer_norm_config(N, C, x2d.device.type)
    n_programs = triton.cdiv(N, rows_per_program)
    dw_partial = torch.empty(n_programs, C, device=x2d.device, dtype=torch.float32)  # one row per group
    # Without a bias the kernel never writes DB_PARTIAL; dw_partial stands in as a valid pointer.
    db_partial = torch.empty_like(dw_partial) if has_bias else dw_partial
    if N:
        _layer_norm_bwd_kernel[(n_programs,)](
            x2d, weight, dy, mean, rstd, dx, dw_partial, db_partial, N, C,
            rows_per_program, x2d.stride(0), dy.stride(0), dx.stride(0), HAS_BIAS=has_bias, BLOCK=block,
            num_warps=num_warps, enable_fp_fusion=FP_FUSION)
    # torch's sum over a fixed (n_programs, C) shape: a fixed reduction order, deterministic on CPU and GPU.
    return dx, dw_partial.sum(0), (db_partial.sum(0) if has_bias else None)


class LayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps: float):
        y, x2d, mean, rstd = layer_norm_forward(x, weight, bias, eps)
        ctx.save_for_backward(x2d, weight, mean, rstd)
        ctx.x_shape, ctx.has_bias = x.shape, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x2d, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layer_norm_backward(dy, x2d, weight, mean, rstd, ctx.has_bias)
        return dx.view(ctx.x_shape), dw, db, None  # dw, db fp32 like the weight and bias (_check_inputs)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """Fused F.layer_norm(x, (C,), weight, bias, eps) over the last dim of x (..., C)."""
    return LayerNormFunction.apply(x, weight, bias, eps)
