"""Rotary position embeddings: the tables, the plain-torch reference and a fused Triton kernel beside it.

Half-split convention (HF's `rotate_half`, as Llama/Qwen3 load it): for x (B, H, T, D), x1 = x[..., :D/2],
x2 = x[..., D/2:], out = cat(x1·cos − x2·sin, x2·cos + x1·sin) with cos, sin (T, D/2) fp32 for position t and
pair i at angle t · base^(−2i/D). rotary_reference computes in fp32 and returns x's dtype.
The kernel reads x through its strides (q and k arrive as transposed views of the projection: no copy), the
(T, D/2) tables once per tile, and writes a contiguous (B, H, T, D) in x's dtype (what attention reads), fp32 math.
Its backward is the same kernel rotating by −θ (sin negated inside): dx1 = dy1·cos + dy2·sin,
dx2 = dy2·cos − dy1·sin, written in x's own layout (the (B, T, H, D) memory of the projection and QK-norm), so the
gradient flows on without a transposing copy. The tables are constants (no gradient). Each output element has one
writer: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from andrea.kernels.launch import FP_FUSION


def rotary_tables(T: int, D: int, base: float, device: torch.device | str | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (T, D // 2) fp32: angle[t, i] = t * base ** (-2i / D)."""
    if D % 2:
        raise ValueError(f"rotary needs an even head dim; got {D}")
    inv_freq = 1.0 / (base ** (torch.arange(0, D, 2, dtype=torch.float32, device=device) / D))  # (D/2,)
    angles = torch.outer(torch.arange(T, dtype=torch.float32, device=device), inv_freq)  # (T, D/2)
    return angles.cos(), angles.sin()


def rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D), cos/sin (T, D/2) fp32 → (B, H, T, D) in x's dtype, rotated by angle θ[t, i]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()  # (B, H, T, D/2) each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@triton.jit
def _rotary_kernel(X, COS, SIN, OUT, H, T, HALF, stride_b, stride_h, stride_t, out_stride_b, out_stride_h,
                   out_stride_t, INVERSE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HALF: tl.constexpr):
    pid_t = tl.program_id(0)
    bh = tl.program_id(1).to(tl.int64)  # int64: B * H * T * D passes 2**31 at long context
    b, h = bh // H, bh % H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    i = tl.arange(0, BLOCK_HALF)
    ok = (t < T)[:, None] & (i < HALF)[None, :]  # (BLOCK_T, BLOCK_HALF)
    table = t[:, None] * HALF + i[None, :]
    cos = tl.load(COS + table, mask=ok, other=0.0)
    sin = tl.load(SIN + table, mask=ok, other=0.0)
    if INVERSE:
        sin = -sin  # the rotation by −θ: the backward of the rotation by θ
    x_offs = b * stride_b + h * stride_h + t[:, None] * stride_t + i[None, :]  # the last dim has stride 1
    x1 = tl.load(X + x_offs, mask=ok, other=0.0).to(tl.float32)  # (BLOCK_T, BLOCK_HALF): x[..., :D/2]
    x2 = tl.load(X + x_offs + HALF, mask=ok, other=0.0).to(tl.float32)  # x[..., D/2:]
    o_offs = b * out_stride_b + h * out_stride_h + t[:, None] * out_stride_t + i[None, :]
    tl.store(OUT + o_offs, (x1 * cos - x2 * sin).to(OUT.dtype.element_ty), mask=ok)
    tl.store(OUT + o_offs + HALF, (x2 * cos + x1 * sin).to(OUT.dtype.element_ty), mask=ok)


def rotary_config(head_dim: int, device_type: str) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_HALF, num_warps), pinned per head dim and device type; never autotuned. GPU: ~2048 pairs a
    program (16 fp32 of each half per thread at 4 warps). Interpreter: 32 positions (each program costs Python
    overhead), so T = 123 spans 4 tiles with a ragged last one."""
    block_half = triton.next_power_of_2(head_dim // 2)
    if device_type == "cpu":
        return 32, block_half, 1
    return max(1, 2048 // block_half), block_half, 4


def rotary_apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
                 layout: torch.Tensor | None = None) -> torch.Tensor:
    """The rotation of x (B, H, T, D) by θ (by −θ with inverse) → (B, H, T, D) in x's dtype, contiguous or with the
    strides of `layout` (a tensor of x's shape, e.g. on the meta device, whose last dim has stride 1)."""
    if x.dim() != 4 or x.shape[-1] % 2 or x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"want x (B, H, T, D) with D even in fp32/bf16/fp16; got {tuple(x.shape)} {x.dtype}")
    B, H, T, D = x.shape
    for name, table in (("cos", cos), ("sin", sin)):
        # the kernel reads the tables as dense (T, D/2) fp32 on x's device: anything else would be read wrongly
        if table.shape != (T, D // 2) or table.dtype != torch.float32 or not table.is_contiguous() \
                or table.device != x.device:
            raise ValueError(f"{name} must be a contiguous ({T}, {D // 2}) fp32 tensor on {x.device}; got "
                             f"{tuple(table.shape)} {table.dtype} on {table.device}")
    if x.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if layout is None or layout.shape != x.shape or layout.stride(-1) != 1:
        out = torch.empty(B, H, T, D, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty_strided(x.shape, layout.stride(), device=x.device, dtype=x.dtype)
    block_t, block_half, num_warps = rotary_config(D, x.device.type)
    if out.numel():
        _rotary_kernel[(triton.cdiv(T, block_t), B * H)](
            x, cos, sin, out, H, T, D // 2, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1),
            out.stride(2), INVERSE=inverse, BLOCK_T=block_t, BLOCK_HALF=block_half, num_warps=num_warps,
            enable_fp_fusion=FP_FUSION)
    return out


class RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        # x's layout, kept without its memory: dense x (the projection's transposed view) gets dx in the same strides
        ctx.layout = torch.empty_like(x, device="meta")
        return rotary_apply(x, cos, sin)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return rotary_apply(dy, cos, sin, inverse=True, layout=ctx.layout), None, None  # the tables are constants


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Fused rotary_reference(x, cos, sin): x (B, H, T, D) → (B, H, T, D) in x's dtype."""
    return RotaryFunction.apply(x, cos, sin)
