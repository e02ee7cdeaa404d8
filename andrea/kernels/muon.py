"""Muon's elementwise parts: the plain-torch references (the fused Triton kernels land beside them).

Muon (train.optimizer = "muon") keeps one fp32 momentum buffer per hidden matrix. Per step:
- muon_momentum_reference(grad, momentum, beta, nesterov): momentum ← lerp(momentum, grad, 1 − beta) in place;
  returns the matrix to orthogonalise: grad.lerp(momentum, beta) with Nesterov, else momentum itself.
- (Newton–Schulz / Polar Express on that matrix runs through torch matmuls, not here.)
- muon_apply_reference(w, update, lr, weight_decay): w ← w · (1 − lr · wd) − lr · update, in place.
Tensors are fp32 of any shape (one matrix, or a flat view of several).
"""

from __future__ import annotations

import torch


@torch.no_grad()
def muon_momentum_reference(grad: torch.Tensor, momentum: torch.Tensor, beta: float, nesterov: bool) -> torch.Tensor:
    momentum.lerp_(grad, 1 - beta)
    return grad.lerp(momentum, beta) if nesterov else momentum


@torch.no_grad()
def muon_apply_reference(w: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float) -> torch.Tensor:
    return w.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)
