"""Muon on the hidden matrices, AdamW on the rest (train.optimizer = "muon"): one update over a range of the flat state.

Reads and updates device memory only (the trainer's flat weights, gradient, m and v, or a ZeRO-1 rank's slice of
them); no files. `MuonAdamW(...)` is registered in andrea/optim/registry.py and called as every update there,
`update(w, g, m, v, hp)`, so the trainer's step (andrea/control/run/trainer.py) and ZeRO-1's
(andrea/control/parallel/zero.py) wire it where AdamW was.

Which optimizer updates a parameter is a pure function of the layout (`muon_matrices`): Muon takes every 2-D
parameter inside a transformer block (`h.<i>.…`: the GPT's attn.c_attn, attn.c_proj, mlp.c_fc and mlp.c_proj, and
the modern arch's projections); AdamW everything else: the embeddings, the output head, biases and norm gains, with
train.lr, its schedule and train.weight_decay as in an AdamW run. A fused projection is orthogonalised per part
(`FUSED`): the GPT's c_attn (3C, C) is q, k and v, three (C, C) matrices, as a split Linear would have them.

The checkpoint keeps its bytes-format (docs/formats.md): for a Muon parameter `m` holds Muon's momentum and `v`
stays zero (Muon keeps nothing else per element); for every other parameter m and v are AdamW's.

One step (the elementwise parts are andrea/kernels/muon_update.py's, fused on a GPU with the Triton kernels):
    g       the gradient, clipped by the global norm over every parameter (train.grad_clip), as AdamW's
    u       momentum.lerp_(g, 1 - β) in place; with Nesterov u = g.lerp(momentum, β), else u = momentum   (fp32)
    O       polar_express(u) ≈ U·Vᵀ for u = U·Σ·Vᵀ: every singular value pushed to ~1 (below)
    w       w · (1 − lr_μ · wd_μ) − lr_μ · max(1, rows/cols)^½ · O
The gradient is spent once its norm is taken, so u (Nesterov's) and then the scaled O are written over it: the
update allocates nothing the size of the matrices beyond one batch's orthogonalisation. The momentum and the
final w pass each run once per run of adjacent matrices (a whole model's blocks are one run), not per matrix.
lr_μ = train.muon_lr · lr / train.lr, lr being AdamW's of the step (lr_at(step) times the guard's lr scale): Muon
follows the same warmup, cosine decay and guard remedy, at its own peak.

Newton–Schulz: Polar Express (Amsel, Persson, Musco and Gower, 2025), the quintic X ← a·X + (b·A + c·A²)·X with
A = X·Xᵀ, with coefficients chosen per step (minimax-optimal for the interval the singular values lie in after the
previous steps) where Keller Jordan's Muon repeats one quintic (3.4445, −4.7750, 2.0315). Same matmuls, a closer
orthogonal factor: 5 steps on a Gaussian (64, 256) matrix leave its singular values in [0.86, 1.14] against the
fixed quintic's [0.68, 1.13], and lift a nearly low-rank gradient's small singular values about twice as far
(tests/unit/optim/test_muon.py); nanochat and modded-nanogpt train with these coefficients. The input is scaled by
1/(1.02·‖u‖_F) first (every singular value below 1, with a margin for bf16 rounding), and a tall matrix is iterated
as its transpose (the smaller X·Xᵀ): a (rows, cols) matrix and a (cols, rows) one share a batch (`batch_key`).
Matmuls in bf16 on a GPU (the fp32 input normalised first), in fp32 elsewhere: deterministic on a CPU, no randomness.

Shape-aware scale: max(1, rows/cols)^½ (rows = out, cols = in: Keller Jordan's Muon, nanochat). O has unit spectral
norm; the factor gives a fan-out-heavy matrix (the MLP's up-projection) the larger step a spectral-norm argument
asks for, and keeps one learning rate right across widths, so train.muon_lr = 0.02 is the known-good value of
those recipes. The alternative, 0.2·sqrt(max(rows, cols)) to match AdamW's update RMS (Moonshot's), would share
AdamW's learning rate instead; andrea keeps Muon's own key, so neither recipe's tuning is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from andrea.config.schema import TrainConfig
from andrea.model.gpt import ParamSpec, decay_mask
from andrea.optim.registry import Hyper

# Five steps, each (a, b, c) for X <- a X + (b A + c A^2) X; from the Polar Express paper's schedule for Muon
# (lower bound 1e-3 on the normalised singular values, the 1.02 safety factor applied below).
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
SAFETY = 1.02
# AdamW's runs shorter than this (biases and norm gains between the matrices) are gathered into one call: one
# launch and one pass of Python for all of them instead of one per run (on ANDREA-tiny's CPU update: 9 calls, ~12 ms
# of overhead, against 0.6 ms for AdamW over the whole buffer). Elementwise, so the bits are the same.
PACK_BELOW = 1 << 16
FUSED = {"attn.c_attn.weight": 3}  # name suffix -> matrices stacked along its rows (q, k, v)


@dataclass(frozen=True)
class Matrix:
    """One Muon parameter: flat elements [offset, offset + numel) of the weights, `parts` stacked (rows, cols)."""

    name: str
    offset: int
    numel: int
    parts: int
    rows: int
    cols: int

    @property
    def scale(self) -> float:
        return max(1.0, self.rows / self.cols) ** 0.5


def is_hidden_matrix(spec: ParamSpec) -> bool:
    """Muon's: a 2-D parameter inside a transformer block (embeddings and the head are outside any block)."""
    return len(spec.shape) == 2 and spec.name.startswith("h.")


def muon_matrices(layout: list[ParamSpec]) -> list[Matrix]:
    """The parameters Muon updates, in layout order."""
    out = []
    for spec in layout:
        if is_hidden_matrix(spec):
            rows, cols = spec.shape
            parts = next((k for suffix, k in FUSED.items() if spec.name.endswith(suffix) and rows % k == 0), 1)
            out.append(Matrix(spec.name, spec.offset, spec.numel, parts, rows // parts, cols))
    return out


def adamw_runs(layout: list[ParamSpec], lo: int, hi: int) -> list[tuple[int, int]]:
    """The maximal runs [a, b) of [lo, hi) outside every Muon matrix, relative to lo: AdamW's part of the range."""
    runs, at = [], lo
    for m in muon_matrices(layout):
        a, b = max(m.offset, lo), min(m.offset + m.numel, hi)
        if a >= b:
            continue
        if a > at:
            runs.append((at - lo, a - lo))
        at = b
    if hi > at:
        runs.append((at - lo, hi - lo))
    return runs


def matrix_spans(layout: list[ParamSpec]) -> list[tuple[int, int]]:
    """(offset, numel) of every Muon matrix: what a ZeRO-1 shard boundary must not cut (control/parallel/distributed.py)."""
    return [(m.offset, m.numel) for m in muon_matrices(layout)]


def batch_key(m: Matrix) -> tuple[int, int]:
    """The shape Polar Express iterates a matrix in, (short side, long side): same-keyed matrices form one batch."""
    return min(m.rows, m.cols), max(m.rows, m.cols)


def batches(matrices: list[Matrix]) -> dict[tuple[int, int], list[Matrix]]:
    """The matrices grouped by `batch_key`, each group in layout order: one orthogonalisation per group. Within a
    group, adjacent same-shaped matrices (a layer's q, k, v and o; its gate and up) are merged into one entry of
    their summed parts, so each is stacked and written back by one call."""
    out: dict[tuple[int, int], list[Matrix]] = {}
    for m in matrices:
        group = out.setdefault(batch_key(m), [])
        last = group[-1] if group else None
        if last and last.offset + last.numel == m.offset and (last.rows, last.cols) == (m.rows, m.cols):
            group[-1] = replace(last, name=f"{last.name}+{m.name}", numel=last.numel + m.numel,
                                parts=last.parts + m.parts)
        else:
            group.append(m)
    return out


def matrix_runs(matrices: list[Matrix]) -> list[tuple[int, int]]:
    """The maximal runs [a, b) of adjacent matrices (layout order): where the elementwise passes run."""
    runs: list[list[int]] = []
    for m in matrices:
        if runs and runs[-1][1] == m.offset:
            runs[-1][1] = m.offset + m.numel
        else:
            runs.append([m.offset, m.offset + m.numel])
    return [(a, b) for a, b in runs]


def workspace_bytes(layout: list[ParamSpec], device: str) -> int:
    """Device memory the update holds beyond the state at its peak (model/memory.py's `optimizer_workspace`), the
    larger of its two phases. Modelled from the tensors `MuonAdamW.__call__` keeps alive together; an upper bound
    that tests/unit/optim/test_muon.py holds against the live bytes a CPU update allocates.
    Muon: for the largest batch (E elements as k matrices (r', c'), r' <= c': `batches`), the stacked input u
    (fp32), the iterate and its next value (12 bytes per element in all), and up to three k·(r', r') squares in
    the matmul dtype (X·Xᵀ and the polynomial of a step while the next X·Xᵀ is made). u and the result are
    written over the gradient, in place.
    AdamW: the gathered copies of the packed short runs (w, g, m, v: 16 bytes per element) and, on a CPU, the
    reference's two scratch slices (andrea/kernels/adamw.py)."""
    from andrea.kernels.adamw import REFERENCE_CHUNK
    width = 2 if device == "cuda" else 4
    muon = max((12 * sum(m.numel for m in ms) + 3 * width * sum(m.parts for m in ms) * short ** 2
                for (short, _), ms in batches(muon_matrices(layout)).items()), default=0)
    runs = [b - a for a, b in adamw_runs(layout, 0, layout[-1].offset + layout[-1].numel)]
    packed = sum(k for k in runs if k < PACK_BELOW)
    scratch = 0 if device == "cuda" else 8 * min(REFERENCE_CHUNK, max(runs + [packed]))
    return max(muon, 16 * packed + scratch)


def polar_express(u: torch.Tensor, steps: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """(k, r, c) fp32 -> (k, r, c) fp32: each matrix's orthogonal factor, approximately (module docstring). The
    matmuls run in `dtype`: by default bf16 on a GPU, fp32 elsewhere. The update hands it wide matrices only."""
    dtype = dtype or (torch.bfloat16 if u.device.type == "cuda" else torch.float32)
    tall = u.shape[-2] > u.shape[-1]
    x = u.mT if tall else u  # (k, r', c'), r' <= c': A = X Xᵀ is the smaller square
    x = x / (torch.linalg.matrix_norm(x, keepdim=True) * SAFETY + 1e-7)  # fp32, before any rounding to bf16
    x = x.to(dtype).contiguous()
    for a, b, c in POLAR_EXPRESS[:steps]:
        gram = x @ x.mT  # (k, r', r')
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b A + c A²
        x = torch.baddbmm(x, poly, x, beta=a, alpha=1.0)  # a X + (b A + c A²) X
    x = x.float()
    return x.mT.contiguous() if tall else x


def _view(flat: torch.Tensor, x: Matrix) -> torch.Tensor:
    """Matrix entry x of a flat range: (parts, rows, cols), a view."""
    return flat[x.offset:x.offset + x.numel].view(x.parts, x.rows, x.cols)


def _wide(u: torch.Tensor) -> torch.Tensor:
    """(k, r, c) → (k, min, max): a tall matrix as its transpose (a view), as Polar Express iterates it."""
    return u.mT if u.shape[-2] > u.shape[-1] else u


def elementwise(kernels: str):
    """(momentum, apply): the fused Triton twins, or the plain-torch references (andrea/kernels/muon_update.py)."""
    if kernels == "triton":
        from andrea.kernels import muon_apply, muon_momentum
        return muon_momentum, muon_apply
    from andrea.kernels import muon_apply_reference, muon_momentum_reference
    return muon_momentum_reference, muon_apply_reference


class MuonAdamW:
    """The update of the flat range [lo, hi) of a model's parameters: Muon on the matrices whose every element is in
    it (a range never cuts one: ZeRO-1's bounds keep matrices whole), AdamW (`adamw`, the trainer's) on the rest."""

    def __init__(self, layout: list[ParamSpec], tc: TrainConfig, adamw, kernels: str, device: torch.device,
                 lo: int = 0, hi: int | None = None):
        hi = layout[-1].offset + layout[-1].numel if hi is None else hi
        from andrea.kernels.adamw import clip_coefficient  # deferred, as the trainer's: Triton imports on first use
        self.tc, self.adamw, self.clip = tc, adamw, clip_coefficient
        self.momentum, self.apply = elementwise(kernels)
        every = muon_matrices(layout)
        inside = [x for x in every if lo <= x.offset and x.offset + x.numel <= hi]
        cut = [x.name for x in every if x.offset < hi and x.offset + x.numel > lo and x not in inside]
        if cut:
            raise ValueError(f"the range [{lo}, {hi}) cuts Muon matrices {cut}: Muon needs whole matrices")
        self.matrices = [replace(x, offset=x.offset - lo) for x in inside]  # relative, like the tensors it gets
        self.matrix_runs = matrix_runs(self.matrices)
        self.batches = batches(self.matrices)
        runs = adamw_runs(layout, lo, hi)
        mask = decay_mask(layout, device)[lo:hi]
        self.runs = [(a, b) for a, b in runs if b - a >= PACK_BELOW]
        self.masks = [mask[a:b] for a, b in self.runs]  # kept: the CPU reference caches its plans per mask
        short = [torch.arange(a, b) for a, b in runs if b - a < PACK_BELOW]
        self.packed = torch.cat(short).to(device) if short else None  # (k,) indices of the short runs' elements
        self.packed_mask = mask[self.packed] if short else None

    @torch.no_grad()
    def __call__(self, w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hp: Hyper) -> torch.Tensor:
        """The update over the range's w, g, m, v (length hi - lo), called as every registered update
        (andrea/optim/registry.py). Returns the pre-clip norm of g, a 0-d device tensor."""
        norm = self.clip_gradient(g, hp.max_grad_norm)
        adamw = hp.adamw(max_grad_norm=None)
        self.adamw_part(w, g, m, v, adamw)
        self._muon(w, g, m, hp.lr * self.tc.muon_lr / self.tc.lr)
        return norm

    def clip_gradient(self, g: torch.Tensor, max_grad_norm: float | None) -> torch.Tensor:
        """g clipped by its global norm, in place; returns the pre-clip norm, a 0-d device tensor."""
        norm, coef = self.clip(g, max_grad_norm)
        if coef is not None and not (g.device.type == "cpu" and coef.item() == 1.0):
            g.mul_(coef)  # every parameter's gradient, once; on a CPU g * 1.0 == g is skipped
        return norm

    def adamw_part(self, w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, adamw: dict) -> None:
        """AdamW (the kernel's keyword arguments `adamw`) on every element outside the matrices."""
        for (a, b), mask in zip(self.runs, self.masks):
            self.adamw(w[a:b], g[a:b], m[a:b], v[a:b], decay_mask=mask, **adamw)
        if self.packed is not None:
            self._adamw_packed(w, g, m, v, adamw)

    def _adamw_packed(self, w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, adamw: dict) -> None:
        """AdamW over the short runs gathered into one call; the gathered copies die with this frame."""
        idx = self.packed
        w_, m_, v_ = w[idx], m[idx], v[idx]  # (k,) gathered copies
        self.adamw(w_, g[idx], m_, v_, decay_mask=self.packed_mask, **adamw)
        for dst, src in ((w, w_), (m, m_), (v, v_)):
            dst.index_copy_(0, idx, src)

    def _muon(self, w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, lr_muon: float) -> None:
        """Muon over every matrix, g (clipped) spent as scratch: Nesterov's u, then the scaled factor."""
        tc = self.tc
        for a, b in self.matrix_runs:  # u: written over g with Nesterov, else the momentum buffer itself
            self.momentum(g[a:b], m[a:b], tc.muon_momentum, tc.muon_nesterov)
        u = g if tc.muon_nesterov else m
        for batch in self.batches.values():
            stacked = torch.cat([_wide(_view(u, x)) for x in batch])  # (Σ parts, r', c'): one copy
            o = polar_express(stacked, tc.muon_ns_steps)  # (Σ parts, r', c') fp32
            at = 0
            for x in batch:  # the scaled factor written over g, in the matrices' own orientation
                o_x = o[at:at + x.parts]
                at += x.parts
                torch.mul(o_x.mT if x.rows > x.cols else o_x, x.scale, out=_view(g, x))
        for a, b in self.matrix_runs:
            self.apply(w[a:b], g[a:b], lr_muon, tc.muon_weight_decay)
