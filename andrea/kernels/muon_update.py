"""Muon's elementwise parts: the plain-torch references and the fused Triton kernels beside them.

Muon (train.optimizer = "muon") keeps one fp32 momentum buffer per hidden matrix. Per step:
- muon_momentum_reference(grad, momentum, beta, nesterov): momentum ← lerp(momentum, grad, 1 − beta) in place;
  returns the matrix to orthogonalise: with Nesterov grad.lerp(momentum, beta), written over grad (the step's
  gradient is spent by then: its norm is taken first, and nothing reads it after the update), else momentum itself.
- (Newton–Schulz / Polar Express on that matrix runs through torch matmuls, not here.)
- muon_apply_reference(w, update, lr, weight_decay): w ← w · (1 − lr · wd) − lr · update, in place.
Tensors are fp32 of any shape (one matrix, or a flat view of several); `update` may also be bf16/fp16 (the
orthogonalised matrix as the matmuls leave it on a GPU), read as its exact fp32 value, as torch's add_ promotes it.

The kernels make one pass over memory each: muon_momentum reads grad and momentum and writes momentum and (with
Nesterov) the update over grad, 16 bytes per element where the two torch lerps take 24; muon_apply reads w and update and writes
w, 12 bytes per fp32 element (10 with a bf16 update) where mul_ then add_ take 20. Their lerps use torch's two-sided
formula (exact at both ends of the weight range), so they match the references within an fp32 ulp or two (the GPU
contracts a*b+c into FMAs, launch.FP_FUSION). The two cannot share a kernel: the orthogonalisation sits between
them. Each element has one writer, no reduction: deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from andrea.kernels.launch import FP_FUSION


@torch.no_grad()
def muon_momentum_reference(grad: torch.Tensor, momentum: torch.Tensor, beta: float, nesterov: bool) -> torch.Tensor:
    momentum.lerp_(grad, 1 - beta)
    return grad.lerp_(momentum, beta) if nesterov else momentum


@torch.no_grad()
def muon_apply_reference(w: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float) -> torch.Tensor:
    return w.mul_(1 - lr * weight_decay).add_(update, alpha=-lr)


@triton.jit
def _muon_momentum_kernel(G, M, U, n, momentum_weight, beta, NESTEROV: tl.constexpr, M_FROM_START: tl.constexpr,
                          U_FROM_START: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: flat buffers may pass 2**31 bytes
    ok = offs < n
    g = tl.load(G + offs, mask=ok, other=0.0)
    m = tl.load(M + offs, mask=ok, other=0.0)
    # torch's two-sided lerp(start, end, w): start + w * (end - start) for |w| < 0.5, else end - (end - start) * (1 - w)
    if M_FROM_START:  # momentum.lerp_(g, 1 - β)
        m = m + momentum_weight * (g - m)
    else:
        m = g - (g - m) * (1.0 - momentum_weight)
    tl.store(M + offs, m, mask=ok)
    if NESTEROV:  # g.lerp(momentum, β)
        if U_FROM_START:
            u = g + beta * (m - g)
        else:
            u = m - (m - g) * (1.0 - beta)
        tl.store(U + offs, u, mask=ok)


@triton.jit
def _muon_apply_kernel(W, UPDATE, n, decay_factor, lr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    w = tl.load(W + offs, mask=ok, other=0.0)
    u = tl.load(UPDATE + offs, mask=ok, other=0.0).to(tl.float32)  # a bf16/fp16 update is exact in fp32
    tl.store(W + offs, w * decay_factor - lr * u, mask=ok)


def muon_config(device_type: str) -> tuple[int, int]:
    """(BLOCK, num_warps), as adamw_config and for the same reasons: GPU 1024 at 4 warps; interpreter 4096."""
    return (4096, 4) if device_type == "cpu" else (1024, 4)


def _check(tensors: dict[str, torch.Tensor], dtypes: dict[str, tuple[torch.dtype, ...]]) -> None:
    first = next(iter(tensors.values()))
    for name, t in tensors.items():
        # the kernels read a flat run of numel elements: a strided view would be read wrongly, not rejected
        if t.shape != first.shape or not t.is_contiguous() or t.device != first.device or t.dtype not in dtypes[name]:
            raise ValueError(f"{name} must be contiguous, shaped {tuple(first.shape)} on {first.device}, in "
                             f"{'/'.join(str(d).split('.')[-1] for d in dtypes[name])}; got {tuple(t.shape)} "
                             f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ', strided'}")
    if first.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)")


FP32 = (torch.float32,)


@torch.no_grad()
def muon_momentum(grad: torch.Tensor, momentum: torch.Tensor, beta: float, nesterov: bool) -> torch.Tensor:
    """muon_momentum_reference in one kernel: same signature and semantics; momentum (and, with Nesterov, grad)
    updated in place."""
    _check({"grad": grad, "momentum": momentum}, {"grad": FP32, "momentum": FP32})
    update = grad if nesterov else momentum
    n = grad.numel()
    if n:
        block, num_warps = muon_config(grad.device.type)
        momentum_weight = 1.0 - beta
        _muon_momentum_kernel[(triton.cdiv(n, block),)](
            grad, momentum, update, n, momentum_weight, beta, NESTEROV=nesterov,
            M_FROM_START=abs(momentum_weight) < 0.5, U_FROM_START=abs(beta) < 0.5, BLOCK=block, num_warps=num_warps,
            enable_fp_fusion=FP_FUSION)
    return update


@torch.no_grad()
def muon_apply(w: torch.Tensor, update: torch.Tensor, lr: float, weight_decay: float) -> torch.Tensor:
    """muon_apply_reference in one kernel: same signature and semantics; w updated in place and returned."""
    _check({"w": w, "update": update}, {"w": FP32, "update": (torch.float32, torch.bfloat16, torch.float16)})
    n = w.numel()
    if n:
        block, num_warps = muon_config(w.device.type)
        _muon_apply_kernel[(triton.cdiv(n, block),)](w, update, n, 1.0 - lr * weight_decay, lr, BLOCK=block,
                                                     num_warps=num_warps, enable_fp_fusion=FP_FUSION)
    return w
