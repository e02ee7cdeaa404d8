"""Muon (andrea/optim/muon.py): which parameters it takes, Polar Express, one update against a by-hand one, the
learning-rate schedule it follows, its ZeRO-1 slices, the bounds that keep matrices whole, and its configuration.
In process, on the CPU (fp32, deterministic); no trainer process."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from andrea.config import load as configload
from andrea.config.check import ConfigError
from andrea.config.schema import TrainConfig
from andrea.kernels import adamw_reference
from andrea.model import arch
from andrea.model.gpt import decay_mask, layout_for, n_params
from andrea.optim import registry
from andrea.optim.registry import Hyper
from andrea.optim.muon import MuonAdamW, adamw_runs, matrix_spans, muon_matrices, polar_express
from andrea.control.parallel.distributed import shard_bounds, whole_cuts
from andrea.control.run.trainer import Trainer, lr_at

CPU = torch.device("cpu")
HIDDEN = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


SMALL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.vocab_size=260", "model.block_size=16"]


def tiny(*overrides: str):
    """andrea-tiny's settings at a quarter of its width: every kind of parameter, a fraction of the work."""
    return configload.load(preset="andrea-tiny", overrides=["train.optimizer=muon", *SMALL, *overrides])


def test_muon_takes_the_hidden_matrices_and_adamw_everything_else():
    cfg = tiny()
    layout = layout_for(cfg.model)
    names = {m.name for m in muon_matrices(layout)}
    assert names == {f"h.{i}.{s}" for i in range(cfg.model.n_layer) for s in HIDDEN}
    qkv = next(m for m in muon_matrices(layout) if m.name.endswith("c_attn.weight"))
    assert (qkv.parts, qkv.rows, qkv.cols) == (3, cfg.model.n_embd, cfg.model.n_embd)  # q, k, v apart
    # AdamW's runs and Muon's matrices tile the flat buffer exactly once
    n = n_params(layout)
    covered = torch.zeros(n, dtype=torch.int32)
    for a, b in adamw_runs(layout, 0, n):
        covered[a:b] += 1
    for m in muon_matrices(layout):
        covered[m.offset:m.offset + m.numel] += 1
    assert bool((covered == 1).all())
    adamw_names = {s.name for s in layout if not any(m.name == s.name for m in muon_matrices(layout))}
    assert {"wte.weight", "wpe.weight", "lm_head.weight", "ln_f.weight", "h.0.attn.c_attn.bias"} <= adamw_names


def test_muon_takes_the_modern_models_projections_and_adamw_its_embedding_and_head():
    cfg = tiny("model.arch=modern")
    layout = arch.layout_for(cfg.model)
    hidden = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    got = {m.name: m.parts for m in muon_matrices(layout)}
    assert set(got) == {s.name for s in layout if s.name.startswith("h.") and len(s.shape) == 2}
    assert {name.split(".")[-2] for name in got} == set(hidden) and set(got.values()) == {1}
    assert {s.name for s in layout if s.name not in got} >= {"wte.weight", "lm_head.weight"}


def fixed_quintic(u: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Keller Jordan's Muon iteration, for comparison."""
    x = u / (torch.linalg.matrix_norm(u, keepdim=True) * 1.02 + 1e-7)
    for _ in range(steps):
        a = x @ x.mT
        x = 3.4445 * x + (-4.7750 * a + 2.0315 * a @ a) @ x
    return x


@pytest.mark.parametrize("shape", [(3, 64, 256), (2, 256, 64), (2, 96, 96)])
def test_polar_express_pushes_every_singular_value_towards_one(shape):
    u = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    o = polar_express(u, 5)
    sv = torch.linalg.svdvals(o)
    assert o.shape == u.shape and o.dtype == torch.float32
    assert float(sv.max()) < 1.15
    if shape[1] != shape[2]:  # a square Gaussian has near-zero singular values no 5 steps lift
        assert float(sv.min()) > 0.85
        assert float(sv.min()) > float(torch.linalg.svdvals(fixed_quintic(u)).min()) + 0.05
    # the orthogonal factor U Vᵀ: o points along it (cosine per matrix)
    uu, _, vh = torch.linalg.svd(u, full_matrices=False)
    cos = (o * (uu @ vh)).sum((-2, -1)) / (o.norm(dim=(-2, -1)) * (uu @ vh).norm(dim=(-2, -1)))
    assert float(cos.min()) > 0.99
    if shape[1] != shape[2]:  # a tall matrix is its transpose's factor, transposed
        assert torch.allclose(polar_express(u.mT.contiguous(), 5), o.mT, atol=1e-6)


def test_polar_express_in_bf16_as_on_a_gpu_stays_near_the_fp32_factor():
    u = torch.randn(2, 64, 192, generator=torch.Generator().manual_seed(1))
    o16, o32 = polar_express(u, 5, torch.bfloat16), polar_express(u, 5)
    assert o16.dtype == torch.float32
    sv = torch.linalg.svdvals(o16)
    assert 0.8 < float(sv.min()) and float(sv.max()) < 1.2
    assert float((o16 - o32).norm() / o32.norm()) < 0.05


def test_polar_express_of_zero_is_zero():
    assert torch.equal(polar_express(torch.zeros(2, 8, 16), 5), torch.zeros(2, 8, 16))


def by_hand(layout, tc: TrainConfig, w, g, m, v, step: int, lr: float, coef: float):
    """One Muon + AdamW update written plainly, one parameter and one part at a time."""
    w, g, m, v = w.clone(), g.clone() * coef, m.clone(), v.clone()
    muon = {x.name: x for x in muon_matrices(layout)}
    lr_muon = lr * tc.muon_lr / tc.lr
    mask = decay_mask(layout)
    for spec in layout:
        s = slice(spec.offset, spec.offset + spec.numel)
        if spec.name not in muon:
            adamw_reference(w[s], g[s], m[s], v[s], step=step, lr=lr, beta1=tc.beta1, beta2=tc.beta2, eps=tc.eps,
                            weight_decay=tc.weight_decay, decay_mask=mask[s].clone())
            continue
        x = muon[spec.name]
        m[s] = tc.muon_momentum * m[s] + (1 - tc.muon_momentum) * g[s]
        u = g[s] + tc.muon_momentum * (m[s] - g[s]) if tc.muon_nesterov else m[s]
        parts = u.view(x.parts, x.rows, x.cols)
        o = torch.cat([polar_express(p[None], tc.muon_ns_steps) for p in parts]).view(-1)
        scale = max(1.0, x.rows / x.cols) ** 0.5
        w[s] = w[s] * (1 - lr_muon * tc.muon_weight_decay) - lr_muon * scale * o
    return w, m, v


@pytest.mark.parametrize("nesterov", [True, False])
def test_one_update_is_muon_on_the_matrices_and_adamw_on_the_rest(nesterov):
    cfg = tiny(f"train.muon_nesterov={str(nesterov).lower()}", "train.muon_weight_decay=0.1", "train.grad_clip=0.5")
    tc, layout = cfg.train, layout_for(cfg.model)
    n = n_params(layout)
    gen = torch.Generator().manual_seed(3)
    w, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen)
    muon = MuonAdamW(layout, tc, adamw_reference, "torch", CPU)
    for x in muon_matrices(layout):  # Muon keeps no v: a Muon run's are zeros
        v[x.offset:x.offset + x.numel] = 0
    coef = min(1.0, 0.5 / (float(g.norm()) + 1e-6))
    want = by_hand(layout, tc, w, g, m, v, 7, 3e-4, coef)
    got = [t.clone() for t in (w, g, m, v)]
    norm = muon(*got, Hyper(7, 3e-4, tc.beta1, tc.beta2, tc.eps, tc.weight_decay, 0.5))
    assert float(norm) == pytest.approx(float(g.norm()), rel=1e-6)  # pre-clip
    is_muon = torch.zeros(n, dtype=torch.bool)
    for x in muon_matrices(layout):
        is_muon[x.offset:x.offset + x.numel] = True
    for name, a, b in (("w", got[0], want[0]), ("m", got[2], want[1]), ("v", got[3], want[2])):
        assert torch.equal(a[~is_muon], b[~is_muon]), name  # AdamW's elements: AdamW's bits
        assert torch.allclose(a[is_muon], b[is_muon], rtol=0, atol=1e-6), name  # batched vs one by one
    assert bool((got[3][is_muon] == 0).all())
    assert not torch.equal(got[0][is_muon], w[is_muon])


def test_the_fused_elementwise_kernels_give_the_references_update():
    """kernels = "triton" (muon_momentum, muon_apply and adamw_step; here under the Triton interpreter) against the
    plain-torch references, on the same state: w, m and v equal within a few fp32 ulps of the weights (g is spent
    as the update's scratch)."""
    from andrea.kernels import adamw_step
    cfg = tiny("train.muon_weight_decay=0.1")
    tc, layout = cfg.train, layout_for(cfg.model)
    n = n_params(layout)
    gen = torch.Generator().manual_seed(5)
    state = [torch.randn(n, generator=gen) for _ in range(3)] + [torch.rand(n, generator=gen)]
    hp = Hyper(4, 1e-3, tc.beta1, tc.beta2, tc.eps, tc.weight_decay, 1.0)
    plain, fused = [t.clone() for t in state], [t.clone() for t in state]
    MuonAdamW(layout, tc, adamw_reference, "torch", CPU)(*plain, hp)
    MuonAdamW(layout, tc, adamw_step, "triton", CPU)(*fused, hp)
    for i in (0, 2, 3):  # w, m, v
        assert torch.allclose(fused[i], plain[i], rtol=1e-6, atol=1e-7)
    assert not torch.equal(fused[0], state[0])


def test_muons_learning_rate_follows_lrs_warmup_and_decay():
    """The change Muon makes to a matrix, from zero momentum, is lr_muon · scale · O: its size over steps is the
    schedule's shape at muon_lr's peak."""
    cfg = tiny("train.warmup_steps=10", "train.lr_decay_steps=30", "train.muon_weight_decay=0", "train.grad_clip=0")
    tc, layout = cfg.train, layout_for(cfg.model)
    n = n_params(layout)
    g = torch.randn(n, generator=torch.Generator().manual_seed(1))
    x = muon_matrices(layout)[0]
    s = slice(x.offset, x.offset + x.numel)
    sizes = {}
    for step in (0, 4, 10, 20, 40):
        w, m, v = torch.zeros(n), torch.zeros(n), torch.zeros(n)
        MuonAdamW(layout, tc, adamw_reference, "torch", CPU)(w, g.clone(), m, v, Hyper(
            step + 1, lr_at(step, tc), tc.beta1, tc.beta2, tc.eps, tc.weight_decay, None))
        sizes[step] = float(w[s].norm())
    unit = sizes[10] / tc.muon_lr  # at the peak: lr_at = lr
    for step, size in sizes.items():
        assert size == pytest.approx(unit * tc.muon_lr * lr_at(step, tc) / tc.lr, rel=1e-5), step


@pytest.mark.parametrize("size", [2, 3, 4])
def test_zero1_bounds_keep_every_matrix_whole_and_the_slices_update_as_the_whole(size):
    cfg = tiny()
    tc, layout = cfg.train, layout_for(cfg.model)
    n, spans = n_params(layout), matrix_spans(layout)
    cuts = whole_cuts(n, size, spans)
    assert cuts[0] == 0 and cuts[-1] == n and list(cuts) == sorted(cuts)
    assert not any(off < c < off + k for c in cuts for off, k in spans)
    biggest = max(k for _, k in spans)
    for r in range(size):  # each boundary within half the largest matrix of the equal split's
        assert abs(cuts[r] - shard_bounds(n, size, r)[0]) <= biggest // 2
    gen = torch.Generator().manual_seed(2)
    w, g, m = (torch.randn(n, generator=gen) for _ in range(3))
    v = torch.rand(n, generator=gen)
    hp = Hyper(3, 1e-3, tc.beta1, tc.beta2, tc.eps, tc.weight_decay, None)
    whole = [t.clone() for t in (w, g, m, v)]
    MuonAdamW(layout, tc, adamw_reference, "torch", CPU)(*whole, hp)
    for r in range(size):
        lo, hi = shard_bounds(n, size, r, cuts)
        part = [t[lo:hi].clone() for t in (w, g, m, v)]
        MuonAdamW(layout, tc, adamw_reference, "torch", CPU, lo, hi)(*part, hp)
        for a, b in zip(part, whole):
            assert torch.allclose(a, b[lo:hi], rtol=0, atol=1e-6)


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by storages allocated inside the mode: a storage counts from the first tensor
    that shows it until the last tensor on it (views included) dies."""

    def __init__(self, existing: list[torch.Tensor]):
        super().__init__()
        self.live = self.peak = 0
        self.existing = {t.untyped_storage().data_ptr() for t in existing}
        self.holders: dict[int, list[int]] = {}  # storage address -> [tensors on it, its bytes]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else [out]:
            if not isinstance(t, torch.Tensor) or t.untyped_storage().data_ptr() in self.existing:
                continue
            key = t.untyped_storage().data_ptr()
            if key not in self.holders:
                self.holders[key] = [0, t.untyped_storage().nbytes()]
                self.live += self.holders[key][1]
                self.peak = max(self.peak, self.live)
            self.holders[key][0] += 1
            weakref.finalize(t, self.release, key)
        return out

    def release(self, key: int) -> None:
        self.holders[key][0] -= 1
        if not self.holders[key][0]:
            self.live -= self.holders.pop(key)[1]


@pytest.mark.parametrize("optimizer", ["muon", "normuon"])
@pytest.mark.parametrize("model", ["gpt2", "modern"])
def test_the_workspace_estimate_bounds_what_an_update_allocates(model, optimizer):
    """`info`'s optimizer workspace (the registry names muon.workspace_bytes for both): NorMuon's extra tensors (its
    per-row moments, the AdamW groups' gathered copies) stay inside Muon's Newton-Schulz peak."""
    from andrea.optim.normuon import NorMuon
    cfg = tiny(f"model.arch={model}", f"train.optimizer={optimizer}")
    tc, layout = cfg.train, arch.layout_for(cfg.model)
    n = n_params(layout)
    state = [torch.randn(n) for _ in range(3)] + [torch.rand(n)]
    update = (NorMuon if optimizer == "normuon" else MuonAdamW)(layout, tc, adamw_reference, "torch", CPU)
    hp = Hyper(3, 1e-3, tc.beta1, tc.beta2, tc.eps, tc.weight_decay, 1.0)
    update(*state, hp)  # the first call also finds the decay mask's runs, once for the run's life
    kept = [t for t in (update.packed, update.packed_mask, *update.masks) if t is not None]  # its own, for life
    for _, long, idx, packed_mask in getattr(update, "groups", ()):  # NorMuon's groups: indices and masks, for life
        kept += [mask for _, mask in long] + [t for t in (idx, packed_mask) if t is not None]
    with LiveBytes(state + kept) as live:
        update(*state, replace(hp, step=4))
    modelled = registry.workspace(optimizer, layout, "cpu")  # what `info` prints
    assert live.peak <= modelled + 64 <= 1.5 * live.peak, (live.peak, modelled)  # + the norms' 0-d scalars


def test_a_range_that_cuts_a_matrix_is_refused():
    cfg = tiny()
    layout = layout_for(cfg.model)
    x = muon_matrices(layout)[1]
    with pytest.raises(ValueError, match="cuts Muon matrices"):
        MuonAdamW(layout, cfg.train, adamw_reference, "torch", CPU, 0, x.offset + 1)


def test_a_muon_trainer_is_deterministic_and_keeps_v_zero_on_its_matrices():
    cfg = tiny()
    x = torch.randint(0, cfg.model.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    states = []
    for _ in range(2):
        t = Trainer(cfg, CPU, kernels="torch")
        for step in range(3):
            t.train_step(step, x, torch.roll(x, -1, dims=1))
        states.append(t.state.buffer.clone())
    assert torch.equal(states[0], states[1])
    n, spans = t.n, matrix_spans(t.layout)
    for off, k in spans:
        assert bool((states[0][2 * n + off:2 * n + off + k] == 0).all())
        assert bool((states[0][n + off:n + off + k] != 0).any())  # Muon's momentum is m


@pytest.mark.parametrize("key,value,message", [
    ("muon_lr", 0.0, "train.muon_lr=0.0 must be > 0"),
    ("muon_momentum", 1.0, "train.muon_momentum=1.0 must be in [0, 1)"),
    ("muon_weight_decay", -0.1, "train.muon_weight_decay=-0.1 must be >= 0"),
    ("muon_ns_steps", 6, "train.muon_ns_steps=6 must be 1 to 5"),
    ("lr", 0.0, "train.lr=0.0 must be > 0 with train.optimizer=muon"),
])
def test_bad_muon_settings_are_refused_on_construction(key, value, message):
    good = TrainConfig(optimizer="muon")
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(good, **{key: value})
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)
