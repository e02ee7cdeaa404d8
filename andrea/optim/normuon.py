"""NorMuon with AdamW groups (train.optimizer = "normuon"): the anchors' optimizer over a range of the flat state.

Reads and updates device memory only, called as every update in andrea/optim/registry.py. Against "muon"
(andrea/optim/muon.py, whose matrices, batches and Polar Express it reuses):
- AdamW groups (`group_of`): the embeddings (wte, wpe) at train.embed_lr with (embed_beta1, embed_beta2) and
  embed_weight_decay, the head at train.head_lr with (head_beta1, head_beta2) and head_weight_decay, both with
  train.group_eps and their lr scaled by √(lr_width / C) (C = the embedding's width: nanochat's 1/√d_model rule,
  tuned at 768); everything else outside the matrices (a GPT's biases and norm gains) keeps train.lr, beta1, beta2,
  eps and weight_decay. Every group's lr follows lr's schedule and the guard's scale (hp.lr / train.lr).
  The modern model's parts (model.value_embeds, resid_lambdas, smear, backout) get nanochat's groups (`PARTS`),
  each with its own train keys and train.group_eps: the value embeddings at train.value_embed_lr (width-scaled as
  embed_lr, nanochat's half of it) with the embeddings' betas and value_embed_weight_decay; the residual lambdas,
  the x0 lambdas, and smear's and backout's scalars at train.<group>_lr, <group>_beta1, <group>_beta2 and
  <group>_weight_decay (resid, x0, smear; not width-scaled). A part's weight decay reaches every parameter of its
  group, vectors too (nanochat decays the residual lambdas toward 0).
- NorMuon's variance reduction (Li et al. 2025, as nanochat): after Polar Express, a second moment of the
  orthogonalised update per index of the matrix's long side (per row of a square one, per part of a fused one),
  decayed by train.normuon_beta2, rescales it row by row (or column by column) and the whole is brought back to
  the norm it had. That moment is kept in the first max(rows, cols) elements of each matrix's `v` (each part's,
  for a fused one; docs/formats.md's table; the rest of its v stays 0), so it travels in the checkpoint and
  resumes exactly.
- Muon's momentum scheduled (`momentum_at`): from muon_momentum_start to muon_momentum over
  muon_momentum_warmup steps, then eased toward muon_momentum_end as the lr's decay progresses.
- Cautious weight decay on a schedule: w ← w − lr_μ·(update + wd_t·w·[update·w ≥ 0]), decaying only where the
  update pulls the same way; wd_t = muon_weight_decay · ½(1 + cos(π · decay progress)) (nanochat's cosine to 0).
The Muon parts run in torch (the cautious mask has no kernel), the AdamW groups through the trainer's AdamW.
"""

from __future__ import annotations

import math

import torch

from andrea.model.gpt import ParamSpec, decay_mask
from andrea.optim.muon import PACK_BELOW, MuonAdamW, _view, _wide, is_hidden_matrix, polar_express
from andrea.optim.registry import Hyper

EMBEDDINGS = ("wte.weight", "wpe.weight")
HEAD = ("lm_head.weight",)
# The modern model's parts (andrea/model/modern.py), nanochat's groups (its gpt.py setup_optimizer): group -> the
# layout names' prefixes; the group's keys are train.<group>_lr and so on (value_embed: _lr and _weight_decay).
PARTS = {"value_embed": ("value_embeds.",), "resid": ("lambdas.resid",), "x0": ("lambdas.x0",),
         "smear": ("smear.", "backout.")}


def group_of(spec: ParamSpec) -> str:
    """embed | head | value_embed | resid | x0 | smear | rest: the AdamW group of a parameter outside the Muon
    matrices."""
    if spec.name in EMBEDDINGS:
        return "embed"
    if spec.name in HEAD:
        return "head"
    return next((g for g, prefixes in PARTS.items() if spec.name.startswith(prefixes)), "rest")


def group_hyper(group: str, tc, width: int, hp: Hyper) -> dict:
    """AdamW's keyword arguments for `group` at this step (no clipping: the update clipped g already)."""
    ratio = hp.lr / tc.lr  # the schedule and the guard's scale
    scale = math.sqrt(tc.lr_width / width) if tc.lr_width else 1.0
    if group == "embed":
        return hp.adamw(lr=tc.embed_lr * scale * ratio, beta1=tc.embed_beta1, beta2=tc.embed_beta2,
                        eps=tc.group_eps, weight_decay=tc.embed_weight_decay, max_grad_norm=None)
    if group == "head":
        return hp.adamw(lr=tc.head_lr * scale * ratio, beta1=tc.head_beta1, beta2=tc.head_beta2,
                        eps=tc.group_eps, weight_decay=tc.head_weight_decay, max_grad_norm=None)
    if group == "value_embed":
        return hp.adamw(lr=tc.value_embed_lr * scale * ratio, beta1=tc.embed_beta1, beta2=tc.embed_beta2,
                        eps=tc.group_eps, weight_decay=tc.value_embed_weight_decay, max_grad_norm=None)
    if group in PARTS:  # the scalars: resid, x0, smear
        lr, beta1, beta2, wd = (getattr(tc, f"{group}_{k}") for k in ("lr", "beta1", "beta2", "weight_decay"))
        return hp.adamw(lr=lr * ratio, beta1=beta1, beta2=beta2, eps=tc.group_eps, weight_decay=wd,
                        max_grad_norm=None)
    return hp.adamw(max_grad_norm=None)


def momentum_at(step: int, progress: float, tc) -> float:
    """Muon's momentum at `step` (0-based): warmed up, then eased toward muon_momentum_end over the decay."""
    if step < tc.muon_momentum_warmup:
        f = step / tc.muon_momentum_warmup
        return (1 - f) * tc.muon_momentum_start + f * tc.muon_momentum
    return (1 - progress) * tc.muon_momentum + progress * tc.muon_momentum_end


def weight_decay_at(progress: float, tc) -> float:
    return tc.muon_weight_decay * 0.5 * (1.0 + math.cos(math.pi * progress))


class NorMuon(MuonAdamW):
    def __init__(self, layout: list[ParamSpec], tc, adamw, kernels: str, device: torch.device, lo: int = 0,
                 hi: int | None = None):
        super().__init__(layout, tc, adamw, kernels, device, lo, hi)
        hi = layout[-1].offset + layout[-1].numel if hi is None else hi
        self.width = next((s.shape[1] for s in layout if s.name == "wte.weight"), 1)
        mask = decay_mask(layout, device)[lo:hi]
        spans: dict[str, list[tuple[int, int]]] = {}
        for s in layout:  # each AdamW parameter's part of [lo, hi), relative, merged with its group's last
            a, b = max(s.offset, lo) - lo, min(s.offset + s.numel, hi) - lo
            if a >= b or is_hidden_matrix(s):
                continue
            group = group_of(s)
            if group in PARTS:  # a part's decay reaches its vectors too (its key's doc)
                mask[a:b] = True
            runs = spans.setdefault(group, [])
            if runs and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], b)
            else:
                runs.append((a, b))
        self.groups = []  # (group, long runs with their masks, packed indices, packed mask)
        for group, runs in spans.items():
            long = [((a, b), mask[a:b]) for a, b in runs if b - a >= PACK_BELOW]
            short = [torch.arange(a, b) for a, b in runs if b - a < PACK_BELOW]
            idx = torch.cat(short).to(device) if short else None
            self.groups.append((group, long, idx, mask[idx] if short else None))

    @torch.no_grad()
    def __call__(self, w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hp: Hyper) -> torch.Tensor:
        tc = self.tc
        norm = self.clip_gradient(g, hp.max_grad_norm)
        for group, long, idx, packed_mask in self.groups:
            kw = group_hyper(group, tc, self.width, hp)
            for (a, b), mask in long:
                self.adamw(w[a:b], g[a:b], m[a:b], v[a:b], decay_mask=mask, **kw)
            if idx is not None:
                w_, m_, v_ = w[idx], m[idx], v[idx]  # (k,) gathered copies
                self.adamw(w_, g[idx], m_, v_, decay_mask=packed_mask, **kw)
                for dst, src in ((w, w_), (m, m_), (v, v_)):
                    dst.index_copy_(0, idx, src)
        self._normuon(w, g, m, v, hp)
        return norm

    def _normuon(self, w: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, hp: Hyper) -> None:
        tc = self.tc
        lr = hp.lr * tc.muon_lr / tc.lr
        beta = momentum_at(hp.step - 1, hp.progress, tc)
        wd = weight_decay_at(hp.progress, tc)
        for a, b in self.matrix_runs:  # u: written over g with Nesterov, else the momentum buffer itself
            self.momentum(g[a:b], m[a:b], beta, tc.muon_nesterov)
        u = g if tc.muon_nesterov else m
        for (short, long), batch in self.batches.items():
            o = polar_express(torch.cat([_wide(_view(u, x)) for x in batch]), tc.muon_ns_steps)  # (K, r', c')
            dim = -1 if short == long else -2  # one moment per index of the long side (per row when square)
            kept = (short, 1) if dim == -1 else (1, long)
            mean_sq = o.square().mean(dim, keepdim=True)  # (K, *kept)
            # each part's moment at the start of that part's own v (a strided view): independent of how adjacent
            # matrices merge into one entry, so a ZeRO-1 slice keeps them where the whole does
            slots = [v[x.offset:x.offset + x.numel].view(x.parts, x.rows * x.cols)[:, :long].view(x.parts, *kept)
                     for x in batch]
            second = torch.cat(slots)
            size = o.shape[dim]
            before = (mean_sq.sum((-2, -1), keepdim=True) * size).sqrt()  # ‖o‖_F per matrix
            second.lerp_(mean_sq, 1 - tc.normuon_beta2)
            step = second.clamp_min(1e-10).rsqrt()
            after = ((mean_sq * size) * step.square()).sum((-2, -1), keepdim=True).sqrt()
            o.mul_(step * (before / after.clamp_min(1e-10)))
            at = 0
            for x, slot in zip(batch, slots):
                slot.copy_(second[at:at + x.parts])
                o_x = o[at:at + x.parts]
                at += x.parts
                torch.mul(o_x.mT if x.rows > x.cols else o_x, x.scale, out=_view(g, x))
        for a, b in self.matrix_runs:  # cautious decay, then the update
            w_, d = w[a:b], g[a:b]
            if wd:
                w_.sub_(w_ * (d * w_ >= 0), alpha=lr * wd)
            w_.sub_(d, alpha=lr)
