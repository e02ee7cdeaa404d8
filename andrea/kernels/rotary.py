"""Rotary position embeddings: the tables, the plain-torch reference (the Triton kernel lands beside it).

Half-split convention (HF's `rotate_half`, as Llama/Qwen3 load it): for x (B, H, T, D), x1 = x[..., :D/2],
x2 = x[..., D/2:], out = cat(x1·cos − x2·sin, x2·cos + x1·sin) with cos, sin (T, D/2) fp32 for position t and
pair i at angle t · base^(−2i/D). The reference computes in fp32 and returns x's dtype.
"""

from __future__ import annotations

import torch


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
