"""The modern model's RMSNorm and rotary in plain torch, each an autograd Function with a one-pass backward: the math
`--kernels torch` runs (a CPU's, and ModelMath's defaults), beside the Triton kernels of `--kernels triton`.

Both are andrea/kernels/'s references (rms_norm_reference, rotary_reference: the ground truth the kernels are held
to) written for speed, and equal to them up to fp32 rounding (tests/unit/model/test_modern.py):
- rms_norm: y = x · rstd, rstd = rsqrt(mean(x²) + eps), fp32 math, x's dtype out; it saves x and rstd (N,) and its
  backward is dx = rstd · (dy − y · mean(dy · y)), five elementwise passes. Autograd through the reference's
  pow, mean, add, rsqrt and mul runs about twice as many and allocates for each (measured on one CPU thread, a
  (16, 128, 128) fp32 forward and backward: 1.9 ms against 7.7 ms).
- rotary: the half-split rotation out = (x1·cos − x2·sin, x2·cos + x1·sin) written into one output, no
  concatenation; it saves only the tables, and its backward is the same rotation by −θ (as the Triton kernel's).
  Against the reference's slices, four products, two sums and a cat, each with its own backward: 0.5 ms
  against 7.0 ms for a (16, 2, 128, 64) forward and backward.
The tables may carry leading dims that broadcast against x (the KV-cached decode gathers each row's own positions:
(B, 1, t, D/2)). Reads and writes nothing.
"""

from __future__ import annotations

import torch


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()  # (..., C): x itself when it is fp32
        rstd = xf.square().mean(-1, keepdim=True).add_(eps).rsqrt_()  # (..., 1)
        ctx.save_for_backward(xf, rstd)
        return (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        xf, rstd = ctx.saved_tensors
        y, dyf = xf * rstd, dy.float()  # (..., C)
        dx = (dyf - y * (dyf * y).mean(-1, keepdim=True)).mul_(rstd)
        return dx.to(dy.dtype), None


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x (..., C) → x · rsqrt(mean(x², -1) + eps), fp32 math, in x's dtype; no weight."""
    return _RMSNorm.apply(x, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., D) rotated pair by pair: (x1·cos − x2·sin, x2·cos + x1·sin), fp32 math, x's dtype out."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # (..., D/2) views
    out = torch.empty(torch.broadcast_shapes(xf.shape, cos.shape[:-1] + (xf.shape[-1],)), dtype=torch.float32,
                      device=x.device)
    o1, o2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=-1.0)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin)
    return out.to(x.dtype)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(dy, cos, -sin), None, None  # the inverse rotation; the tables are constants


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D), cos/sin (T, D/2) fp32 (or broadcastable to (..., T, D/2)) → x rotated, in x's dtype."""
    return _Rotary.apply(x, cos, sin)
