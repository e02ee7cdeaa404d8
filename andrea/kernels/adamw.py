"""AdamW on the flat fp32 buffers: the plain-torch reference and the fused Triton kernel beside it.

Reads and updates in place four 1-D fp32 tensors of equal length: weights `w`, gradient `g`, first moment
`m` and second moment `v` (views into the trainer's flat `[w | m | v]` state and its gradient buffer).
Semantics are exactly `torch.optim.AdamW`: decoupled weight decay applied before the moment update,
bias-corrected step size; plus the trainer's two extras:
- `decay_mask`: a bool tensor (True = decay); None decays everything. The CPU reference caches where a mask's
  runs lie, keyed on the tensor and its version counter: change a mask in place, never through `.data`.
- `max_grad_norm`: global-norm clipping computed on the device (no host sync); the clip factor
  min(1, max_norm / (norm + 1e-6)) is applied to the gradient inside the update, as clip_grad_norm_.
Returns the pre-clip global gradient norm as a 0-d device tensor (for logging without a sync).

`adamw_step` is the drop-in kernel: one torch reduction for the norm/clip factor (shared with the reference, so the
norm is the same bits), then ONE Triton launch that reads w, g, m, v (+ the clip factor by pointer and the mask) and
writes w, m, v in place: 28 bytes per parameter. Results match adamw_reference within a few fp32 ulps (the GPU
contracts a*b+c into FMAs, launch.FP_FUSION; torch's CPU kernels vectorise differently); see
tests/unit/kernels/test_adamw.py.
"""

from __future__ import annotations

import functools
import itertools
import math
import weakref

import torch
import triton
import triton.language as tl

from andrea.kernels.launch import FP_FUSION


def clip_coefficient(g: torch.Tensor, max_grad_norm: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(global L2 norm of g, clip factor or None) — same formula as torch.nn.utils.clip_grad_norm_."""
    norm = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
    if not max_grad_norm:
        return norm, None
    return norm, torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)


# Elements per slice: 1 MiB fp32 scratch stays in cache, no model-sized temporaries. Measured on ANDREA-12M, one
# thread: 1 << 17 was faster only while mixed slices took the masked multiply; with the per-run decay below,
# 1 << 18 is ~0.8 ms/step faster (half the per-slice dispatch).
REFERENCE_CHUNK = 1 << 18
_MAX_RUNS = 8  # a slice with more decayed runs than this takes one masked multiply, not a scalar one per run


@torch.no_grad()
def adamw_reference(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int, lr: float,
                    beta1: float, beta2: float, eps: float, weight_decay: float,
                    decay_mask: torch.Tensor | None = None, max_grad_norm: float | None = None) -> torch.Tensor:
    """The update in slices of REFERENCE_CHUNK elements through two reused scratch buffers.

    Elementwise, so slicing changes no result bit; what it saves is four model-sized temporaries per step
    (the trainer's CPU path: ~200 MB of fresh pages per call on ANDREA-12M, 3-4x slower than this).
    Passes that cannot change a bit are skipped: x * 1.0 and x / 1.0 are x, so a decay factor of 1 and a bias
    correction that has reached 1 (late training) cost nothing, and on a CPU neither does a clip factor of exactly 1
    (reading it there syncs nothing). On a CPU, weight decay multiplies each slice's runs of True in the mask by a
    scalar (w * 1.0 == w elsewhere: the same bits as the masked multiply, which stays for slices of many short runs);
    the runs are found once per mask (_decay_plans). On a GPU the whole tensor is one slice, the mask is applied as a
    tensor and nothing is read back to the host (no sync).
    """
    norm, coef = clip_coefficient(g, max_grad_norm)
    n = w.numel()
    if n == 0:
        return norm
    bias_correction1 = 1.0 - beta1 ** step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2 ** step)
    decay_factor, step_size = 1.0 - lr * weight_decay, -lr / bias_correction1
    lerp_weight, one_minus_beta2 = 1.0 - beta1, 1.0 - beta2
    cpu = w.device.type == "cpu"
    if cpu and coef is not None and coef.item() == 1.0:
        coef = None  # g * 1.0 == g bit for bit: clipping is a no-op pass (a CPU tensor: .item() syncs nothing)
    # Slices pay on a CPU (cache-sized passes); on a GPU they would only multiply launches and host syncs.
    chunk = REFERENCE_CHUNK if cpu else n
    if not weight_decay or decay_factor == 1.0:
        plans = itertools.repeat(())  # w * 1.0 == w: no decay pass
    elif decay_mask is None:
        plans = itertools.repeat(((0, chunk),))
    else:
        plans = _decay_plans(decay_mask, chunk) if cpu else (None,)  # a GPU reads no mask on the host
    masks = decay_mask.split(chunk) if decay_mask is not None else itertools.repeat(None)
    a_full, b_full = torch.empty(2, min(chunk, n), dtype=w.dtype, device=w.device)
    for w_, m_, v_, g_, plan, mask_ in zip(w.split(chunk), m.split(chunk), v.split(chunk), g.split(chunk), plans,
                                          masks):
        k = w_.numel()
        a, b = (a_full, b_full) if k == a_full.numel() else (a_full[:k], b_full[:k])
        if coef is not None:
            g_ = torch.mul(g_, coef, out=a)
        if plan is None:  # w * 1.0 == w outside the mask: the same bits as a multiply by decay_factor per run
            w_.mul_(b.fill_(1.0).masked_fill_(mask_, decay_factor))
        else:
            for lo, hi in plan:
                (w_ if lo == 0 and hi >= k else w_[lo:hi]).mul_(decay_factor)
        m_.lerp_(g_, lerp_weight)
        v_.mul_(beta2).addcmul_(g_, g_, value=one_minus_beta2)
        denom = torch.sqrt(v_, out=b)
        if bias_correction2_sqrt != 1.0:  # 1.0 once beta2 ** step < 2 ** -53 (step > ~720 at beta2 = 0.95)
            denom.div_(bias_correction2_sqrt)
        w_.addcdiv_(m_, denom.add_(eps), value=step_size)
    return norm


_plans_cache: dict[tuple[int, int], tuple[weakref.ref, tuple, list]] = {}  # (id(mask), chunk) -> (ref, key, plans)


def _decay_plans(mask: torch.Tensor, chunk: int) -> list[tuple[tuple[int, int], ...] | None]:
    """Per slice of `chunk` elements, the (lo, hi) runs of True in it (slice-relative), or None for a masked multiply.

    Computed once per mask (~20 ms on ANDREA-12M's; the per-step alternative was two reductions per slice) and cached
    on the mask's identity, held by a weak reference (the cache keeps no mask alive and forgets it when it dies),
    checked against its address, length, stride, dtype and version counter. The trainer builds its mask once and
    never changes it; any in-place write through the tensor or a view of it bumps `_version` and the plans are rebuilt.
    Not seen: writes that bypass the version counter (through `.data`, `.numpy()` or the storage): do not mutate a
    mask that way between steps.
    """
    slot = (id(mask), chunk)
    key = (mask.data_ptr(), mask.numel(), mask.stride(), mask.dtype, mask._version)
    hit = _plans_cache.get(slot)
    if hit is not None and hit[0]() is mask and hit[1] == key:
        return hit[2]
    plans = _runs_per_slice(mask, chunk)
    _plans_cache[slot] = (weakref.ref(mask, functools.partial(_forget_plans, slot)), key, plans)
    return plans


def _forget_plans(slot: tuple[int, int], ref: weakref.ref) -> None:
    hit = _plans_cache.get(slot)
    if hit is not None and hit[0] is ref:  # not a newer mask's entry under a reused id
        _plans_cache.pop(slot, None)


def _runs_per_slice(mask: torch.Tensor, chunk: int) -> list[tuple[tuple[int, int], ...] | None]:
    n = mask.numel()
    # bounds: where each run of equal values starts, and n; run r is True iff r is even and mask[0] is, or r is odd
    # and mask[0] is not.
    flips = (mask[1:] != mask[:-1]).nonzero().flatten() + 1
    bounds = torch.cat([flips.new_zeros(1), flips, flips.new_full((1,), n)])
    first_true = 0 if bool(mask[0]) else 1
    los = torch.arange(0, n, chunk)
    first = (torch.searchsorted(bounds, los, right=True) - 1).tolist()  # the run holding lo
    last = torch.searchsorted(bounds, (los + chunk).clamp_max(n)).tolist()  # one past the run holding hi - 1
    plans: list[tuple[tuple[int, int], ...] | None] = []
    for lo, r0, r1 in zip(los.tolist(), first, last):
        if r1 - r0 > 2 * _MAX_RUNS:  # more than _MAX_RUNS runs of True
            plans.append(None)
            continue
        hi, edges = min(lo + chunk, n), bounds[r0:r1 + 1].tolist()
        plans.append(tuple((max(edges[i], lo) - lo, min(edges[i + 1], hi) - lo)
                           for i in range(r1 - r0) if (r0 + i) % 2 == first_true % 2))
    return plans


@triton.jit
def _adamw_kernel(W, G, M, V, DECAY_MASK, CLIP, n, lerp_weight, beta2, one_minus_beta2, decay_factor, step_size,
                  bias_correction2_sqrt, eps, HAS_MASK: tl.constexpr, HAS_CLIP: tl.constexpr,
                  LERP_FROM_START: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: flat buffers may pass 2**31 bytes
    ok = offs < n
    w = tl.load(W + offs, mask=ok, other=0.0)
    g = tl.load(G + offs, mask=ok, other=0.0)
    m = tl.load(M + offs, mask=ok, other=0.0)
    v = tl.load(V + offs, mask=ok, other=0.0)
    if HAS_CLIP:
        g = g * tl.load(CLIP)  # factor read on device: no host sync between the norm and the update
    if HAS_MASK:
        decay = tl.load(DECAY_MASK + offs, mask=ok, other=0)
        w = w * tl.where(decay != 0, decay_factor, 1.0)
    else:
        w = w * decay_factor
    # m.lerp_(g, 1 - beta1), with torch's two-sided formula (exact at both ends of the weight range).
    if LERP_FROM_START:
        m = m + lerp_weight * (g - m)
    else:
        m = g - (g - m) * (1.0 - lerp_weight)
    v = v * beta2 + one_minus_beta2 * g * g
    # Round-to-nearest sqrt and division, as torch: Triton's default fp32 sqrt and `/` are approximate on NVIDIA.
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    w = w - step_size * tl.div_rn(m, denom)
    tl.store(W + offs, w, mask=ok)
    tl.store(M + offs, m, mask=ok)
    tl.store(V + offs, v, mask=ok)


def adamw_config(device_type: str) -> tuple[int, int]:
    """(BLOCK, num_warps): elements per program and its warps, pinned per device type; never autotuned.
    GPU: 1024 at 4 warps (8 fp32 per thread, enough bytes in flight to stream HBM). Interpreter: 4096, since each
    program costs Python overhead; odd lengths still span several programs."""
    return (4096, 4) if device_type == "cpu" else (1024, 4)


@torch.no_grad()
def adamw_step(w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, step: int, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float,
               decay_mask: torch.Tensor | None = None, max_grad_norm: float | None = None) -> torch.Tensor:
    """adamw_reference as one fused kernel: same signature, same semantics, updates w, m, v in place."""
    n = w.numel()
    for name, t in (("w", w), ("g", g), ("m", m), ("v", v)):
        if t.dtype != torch.float32 or t.dim() != 1 or t.numel() != n or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous 1-D fp32 tensor of length {n}")
    if decay_mask is not None and (decay_mask.dtype != torch.bool or decay_mask.shape != (n,)):
        raise ValueError(f"decay_mask must be a bool tensor of shape ({n},)")
    if w.device.type == "cpu" and not triton.knobs.runtime.interpret:
        raise RuntimeError("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1 before importing triton)")
    norm, coef = clip_coefficient(g, max_grad_norm)
    if n == 0:
        return norm
    lerp_weight = 1.0 - beta1
    block, num_warps = adamw_config(w.device.type)
    _adamw_kernel[(triton.cdiv(n, block),)](
        w, g, m, v,
        decay_mask.contiguous().view(torch.uint8) if decay_mask is not None else w,  # unused pointer when no mask
        coef if coef is not None else norm,  # unused pointer when not clipping
        n, lerp_weight, beta2, 1.0 - beta2, 1.0 - lr * weight_decay, lr / (1.0 - beta1 ** step),
        math.sqrt(1.0 - beta2 ** step), eps,
        HAS_MASK=decay_mask is not None, HAS_CLIP=coef is not None, LERP_FROM_START=abs(lerp_weight) < 0.5,
        BLOCK=block, num_warps=num_warps, enable_fp_fusion=FP_FUSION)
    return norm
