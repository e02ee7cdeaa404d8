"""The modern model's RMSNorm and its QK-norm-then-rotary in plain torch, each an autograd Function with a one-pass
backward: the math `--kernels torch` runs (a CPU's, and ModelMath's defaults), beside the Triton kernels of
`--kernels triton`.

Both are andrea/kernels/'s references (rms_norm_reference, rotary_reference: the ground truth the kernels are held
to) written for speed, and equal to them up to fp32 rounding (tests/unit/model/test_modern.py):
- rms_norm: y = x · r, r = rsqrt(mean(x²) + eps), fp32 math, x's dtype out. It saves x and r (N,); its backward is
  dx = r · dy − x · r³ · mean(dy · x), the sum of squares and the dot product each one `vecdot` (a reduction that
  writes nothing the size of x): four passes over x in all, forward and backward. Autograd through the
  reference's pow, mean, add, rsqrt and mul runs about three times as many and allocates for each.
- qkv_heads: the fused q|k|v projection's output split into heads, q and k RMS-normalised per head and rotated
  (the half-split rotation (x1·cos − x2·sin, x2·cos + x1·sin)), v passed through: one Function for what was two
  norms, two rotations and an unbind, whose backward writes the projection's whole gradient in place of the
  zero-filled slices each part's backward would add up. It saves q and k (one contiguous fp32 copy, the norm's
  input) and their r, and returns v as its own contiguous copy (attention saves it): as many bytes as the separate
  parts kept of the projection, which is not kept itself. The rotation's backward is the rotation by −θ.
Measured on one CPU thread, forward and backward, against the parts they replace (bench/recipe.py's shape,
(8, 128) tokens, C = 64, one head): rms_norm 0.29 ms against 0.31 ms at C = 64, 2.5 ms against 6.5 ms at
(4, 256, 768); qkv_heads ~1.3 ms less per step of the two-layer model.
The tables may carry a leading batch dim (the KV-cached decode gathers each row's own positions: (B, t, hs/2)).
Reads and writes nothing.
"""

from __future__ import annotations

import torch


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """xf (..., C) fp32 → rsqrt(mean(x²) + eps) (..., 1)."""
    return torch.linalg.vecdot(xf, xf).unsqueeze(-1).div_(xf.shape[-1]).add_(eps).rsqrt_()


def _norm_backward(dy: torch.Tensor, xf: torch.Tensor, rstd: torch.Tensor, out: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """d(x · r)/dx applied to dy (..., C), fp32: r · dy − x · r³ · mean(dy · x), written into `out` if given."""
    coef = torch.linalg.vecdot(dy, xf).unsqueeze(-1).mul_(rstd.pow(3)).div_(-xf.shape[-1])  # (..., 1)
    return torch.mul(dy, rstd, out=out).addcmul_(xf, coef)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()  # (..., C): x itself when it is fp32
        rstd = _rstd(xf, eps)  # (..., 1)
        ctx.save_for_backward(xf, rstd)
        return (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, None]:
        xf, rstd = ctx.saved_tensors
        return _norm_backward(dy.float(), xf, rstd).to(dy.dtype), None


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x (..., C) → x · rsqrt(mean(x², -1) + eps), fp32 math, in x's dtype; no weight."""
    return _RMSNorm.apply(x, eps)


def _rotate_into(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor, inverse: bool = False
                 ) -> torch.Tensor:
    """x (..., D) rotated pair by pair into `out` (..., D) fp32: (x1·cos − x2·sin, x2·cos + x1·sin), or by −θ
    (x1·cos + x2·sin, x2·cos − x1·sin) when `inverse` (the rotation's backward)."""
    x1, x2 = x.chunk(2, dim=-1)  # (..., D/2) views
    o1, o2 = out.chunk(2, dim=-1)
    sign = 1.0 if inverse else -1.0
    torch.mul(x1, cos, out=o1).addcmul_(x2, sin, value=sign)
    torch.mul(x2, cos, out=o2).addcmul_(x1, sin, value=-sign)
    return out


def _qk_tables(cos: torch.Tensor, sin: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (..., T, hs/2) → contiguous (..., T, 2, nh, hs/2): the tables laid out as q|k's halves are, so no
    product below broadcasts. A product broadcast along the middle dims ran ~3x slower on one CPU thread
    ((8, 128, 2, 1, 32) fp32: 231 us against 76 us for a rotation)."""
    lead, half = cos.shape[:-1], cos.shape[-1]
    return tuple(t.repeat(*[1] * len(lead), 2 * n_head).view(*lead, 2, n_head, half) for t in (cos, sin))


class _QkvHeads(torch.autograd.Function):
    """qkv (B, T, 3, nh, hs) → q, k (normalised, rotated), v, each (B, nh, T, hs)."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float):
        # q and k in one contiguous fp32 copy and v in its own: every product below runs over whole rows, and
        # the projection itself is not kept (the copies are what the separate norms and attention saved)
        xf = qkv[:, :, :2].float().contiguous()  # (B, T, 2, nh, hs)
        v = qkv[:, :, 2].contiguous()  # (B, T, nh, hs)
        rstd = _rstd(xf, eps)  # (B, T, 2, nh, 1)
        cos2, sin2 = _qk_tables(cos, sin, xf.shape[3])
        rotated = _rotate_into(xf * rstd, cos2, sin2, torch.empty_like(xf)).to(qkv.dtype)
        ctx.save_for_backward(xf, rstd, cos, sin)
        q, k = rotated.unbind(2)  # (B, T, nh, hs) each
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        xf, rstd, cos, sin = ctx.saved_tensors
        cos2, sin2 = _qk_tables(cos, sin, xf.shape[3])
        drot = torch.stack((dq.transpose(1, 2), dk.transpose(1, 2)), dim=2).float()  # (B, T, 2, nh, hs)
        dx = _norm_backward(_rotate_into(drot, cos2, sin2, torch.empty_like(drot), inverse=True), xf, rstd)
        return torch.cat((dx.to(dq.dtype), dv.transpose(1, 2).unsqueeze(2)), dim=2), None, None, None


def qkv_heads(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv (B, T, 3, nh, hs), the fused projection's output; cos/sin (T, hs/2) or (B, T, hs/2) fp32 →
    q and k RMS-normalised per head (fp32 math) then rotated, and v; each (B, nh, T, hs) in qkv's dtype."""
    return _QkvHeads.apply(qkv, cos, sin, eps)
