"""Parameter-free RMSNorm over the last dim: the plain-torch reference (the fused Triton kernel lands beside it).

x (..., C) in any float dtype → y (..., C) in x's dtype, y = x * rsqrt(mean(x², -1) + eps), with no weight (the
modern GPT's norm, docs/architecture.md). The reference computes in fp32 whatever x's dtype and rounds once at the
end: the ground truth the kernel is held to.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()  # (..., C) fp32 math for every input dtype
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)  # (..., C) in x's dtype
