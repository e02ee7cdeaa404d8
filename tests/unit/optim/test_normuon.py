"""NorMuon with AdamW groups (andrea/optim/normuon.py): where its second moment sits in v, the groups' own AdamW,
the guard's lr scale reaching every group, the schedules of its momentum and weight decay, ZeRO-1 slices equal to
the whole, and a resume from the state bit for bit. In process, on the CPU; no trainer process."""

from __future__ import annotations

import math

import pytest
import torch

from andrea.config import load as configload
from andrea.control.parallel.distributed import shard_bounds, whole_cuts
from andrea.control.run.trainer import Trainer
from andrea.kernels import adamw_reference
from andrea.model.gpt import decay_mask, n_params
from andrea.model.arch import layout_for
from andrea.optim.muon import matrix_spans, muon_matrices
from andrea.optim.normuon import NorMuon, momentum_at, weight_decay_at
from andrea.optim.registry import Hyper

CPU = torch.device("cpu")
SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.vocab_size=260", "model.block_size=16"]


def tiny(*overrides: str):
    return configload.load(preset="andrea-tiny", overrides=["train.optimizer=normuon", *SMALL, *overrides])


def state(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)]


@pytest.mark.parametrize("model", ["gpt2", "modern"])
def test_the_second_moment_is_kept_in_the_first_long_side_elements_of_each_matrixs_v(model):
    cfg = tiny(f"model.arch={model}")
    layout = layout_for(cfg.model)
    w, g, m, v = state(n_params(layout), 1)
    NorMuon(layout, cfg.train, adamw_reference, "torch", CPU)(w, g, m, v, Hyper(1, 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0))
    for x in muon_matrices(layout):
        held = max(x.rows, x.cols)
        for part in v[x.offset:x.offset + x.numel].view(x.parts, x.rows * x.cols):  # a fused c_attn: q, k, v
            assert bool((part[:held] > 0).all()) and not part[held:].any(), x.name


def test_the_embedding_and_head_groups_take_their_own_adamw_and_width_scaled_lr():
    cfg = tiny("train.grad_clip=0")
    tc, layout = cfg.train, layout_for(cfg.model)
    n = n_params(layout)
    w, g, m, v = state(n, 2)
    hp = Hyper(1, tc.lr * 0.5, tc.beta1, tc.beta2, tc.eps, tc.weight_decay, None)
    got = [t.clone() for t in (w, g, m, v)]
    NorMuon(layout, tc, adamw_reference, "torch", CPU)(*got, hp)
    mask = decay_mask(layout, CPU)
    scale = math.sqrt(768 / 32)
    for name, lr, b1, b2, wd in (("wte.weight", tc.embed_lr, tc.embed_beta1, tc.embed_beta2, tc.embed_weight_decay),
                                 ("lm_head.weight", tc.head_lr, tc.head_beta1, tc.head_beta2, tc.head_weight_decay)):
        s = next(p for p in layout if p.name == name)
        r = slice(s.offset, s.offset + s.numel)
        want = [t[r].clone() for t in (w, g, m, v)]
        adamw_reference(*want, step=1, lr=lr * scale * 0.5, beta1=b1, beta2=b2, eps=tc.group_eps, weight_decay=wd,
                        decay_mask=mask[r])
        for a, b in zip((got[0][r], got[2][r], got[3][r]), (want[0], want[2], want[3])):
            assert torch.equal(a, b), name


def test_the_guards_lr_scale_reaches_every_group():
    """The trainer's lr scale at 0.5 (the guard's remedy) halves the change of every parameter on a first step from
    the same state and batch (no decay, no clipping): every AdamW group and the matrices."""
    cfg = tiny("model.arch=gpt2", "train.grad_clip=0", "train.weight_decay=0", "train.embed_weight_decay=0",
               "train.head_weight_decay=0", "train.muon_weight_decay=0", "train.warmup_steps=1")
    x = torch.randint(0, cfg.model.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    changes = []
    for scale in (1.0, 0.5):
        trainer = Trainer(cfg, CPU, kernels="torch")
        trainer.lr_scale = scale
        w0 = trainer.state.w.clone()
        trainer.train_step(0, x, torch.roll(x, -1, dims=1))
        changes.append(trainer.state.w - w0)
    for s in trainer.layout:
        r = slice(s.offset, s.offset + s.numel)
        ratio = float(changes[1][r].norm() / changes[0][r].norm())
        assert ratio == pytest.approx(0.5, rel=1e-3), s.name


def test_momentum_warms_up_then_eases_and_weight_decay_follows_the_decay_on_a_cosine():
    tc = tiny("train.muon_momentum=0.97", "train.muon_momentum_warmup=400", "train.muon_weight_decay=0.2").train
    assert momentum_at(0, 0.0, tc) == pytest.approx(0.85) and momentum_at(200, 0.3, tc) == pytest.approx(0.91)
    assert momentum_at(400, 0.0, tc) == pytest.approx(0.97) and momentum_at(900, 1.0, tc) == pytest.approx(0.90)
    assert weight_decay_at(0.0, tc) == pytest.approx(0.2) and weight_decay_at(0.5, tc) == pytest.approx(0.1)
    assert weight_decay_at(1.0, tc) == pytest.approx(0.0, abs=1e-12)


def test_weight_decay_is_cautious():
    """Only the elements whose update pulls the same way as the weight are decayed: with a huge decay, the
    others move by the update alone."""
    cfg = tiny("train.grad_clip=0")
    tc, layout = cfg.train, layout_for(cfg.model)
    n = n_params(layout)
    out = []
    for wd in (0.0, 5.0):
        w, g, m, v = state(n, 4)
        cfg.train.muon_weight_decay = wd
        NorMuon(layout, cfg.train, adamw_reference, "torch", CPU)(w, g, m, v, Hyper(1, tc.lr, tc.beta1, tc.beta2,
                                                                                    tc.eps, 0.0, None))
        out.append(w)
    x = muon_matrices(layout)[0]
    r = slice(x.offset, x.offset + x.numel)
    w0 = state(n, 4)[0][r]
    same = out[0][r] == out[1][r]  # not decayed
    assert same.any() and (~same).any()
    undecayed_update = out[0][r] - w0  # −lr·update
    assert bool((undecayed_update[~same] * w0[~same] <= 0).all())  # decayed where update·w ≥ 0
    assert bool((undecayed_update[same] * w0[same] > 0).all())


@pytest.mark.parametrize("size", [2, 3])
def test_zero1_slices_update_as_the_whole(size):
    cfg = tiny()
    tc, layout = cfg.train, layout_for(cfg.model)
    n = n_params(layout)
    cuts = whole_cuts(n, size, matrix_spans(layout))
    hp = Hyper(3, 1e-3, tc.beta1, tc.beta2, tc.eps, tc.weight_decay, None, progress=0.2)
    whole = state(n, 5)
    whole[3] = torch.rand(n)
    parts_in = [t.clone() for t in whole]
    NorMuon(layout, tc, adamw_reference, "torch", CPU)(*whole, hp)
    for r in range(size):
        lo, hi = shard_bounds(n, size, r, cuts)
        part = [t[lo:hi].clone() for t in parts_in]
        NorMuon(layout, tc, adamw_reference, "torch", CPU, lo, hi)(*part, hp)
        for a, b in zip(part, whole):
            assert torch.allclose(a, b[lo:hi], rtol=0, atol=1e-6)


@pytest.mark.parametrize("model", ["gpt2", "modern"])
def test_a_resume_from_the_state_is_bit_for_bit(model):
    cfg = tiny(f"model.arch={model}", "train.warmup_steps=2", "train.muon_weight_decay=0.1", "train.lr_decay_steps=8")
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (4, 16), generator=gen) for _ in range(6)]

    def run(t: Trainer, steps) -> None:
        for s in steps:
            t.train_step(s, batches[s], torch.roll(batches[s], -1, dims=1))

    straight = Trainer(cfg, CPU, kernels="torch")
    run(straight, range(6))
    first = Trainer(cfg, CPU, kernels="torch")
    run(first, range(3))
    resumed = Trainer(cfg, CPU, kernels="torch")
    resumed.load(first.state.buffer.clone())
    run(resumed, range(3, 6))
    assert torch.equal(resumed.state.buffer, straight.state.buffer)
