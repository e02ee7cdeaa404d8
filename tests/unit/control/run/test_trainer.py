"""The optimizer's step semantics on the reference path: the update that produces the checkpoint of header step
S + 1 uses AdamW's bias correction of step S + 1 (andrea/control/run/trainer.py), as torch.optim.AdamW does for an optimizer
whose state says S updates are done.

Why it matters: a resume loads [w | m | v] of header step S and must continue exactly as a run that never
stopped. An off-by-one in the bias correction (S, or max(S, 1)) changes every update's size — by 27 % at S = 3
with beta1 = 0.9 — and the same checkpoint resumed by another implementation would diverge from it.
"""

from __future__ import annotations

import pytest
import torch

from andrea.config import load as configload
from andrea.control.run.trainer import Trainer, lr_at


def moments_after(trainer: Trainer, steps: int, seed: int) -> torch.Tensor:
    """A plausible [w | m | v] at header step `steps`: the initial weights, m ~ N(0, 1e-3), v ~ m² + 1e-6
    (zero moments at step 0, as a fresh run has)."""
    gen = torch.Generator().manual_seed(seed)
    n = trainer.n
    state = trainer.state.buffer.clone()
    if steps:
        m = 1e-3 * torch.randn(n, generator=gen)
        state[n:2 * n], state[2 * n:] = m, m * m + 1e-6 * torch.rand(n, generator=gen)
    return state


def torch_adamw(trainer: Trainer, state: torch.Tensor, grad: torch.Tensor, steps_done: int) -> torch.Tensor:
    """[w | m | v] after one torch.optim.AdamW step from `state` with state["step"] = steps_done, clipping and the
    decay mask as the trainer's config says."""
    tc, n, mask = trainer.cfg.train, trainer.n, trainer.decay
    w, m, v = state.split(n)
    groups = []
    for where, decay in ((mask, tc.weight_decay), (~mask, 0.0)):
        p = w[where].clone().requires_grad_()
        p.grad = grad[where].clone()
        groups.append((p, where, decay))
    opt = torch.optim.AdamW([{"params": [p], "weight_decay": d} for p, _, d in groups], lr=lr_at(steps_done, tc),
                            betas=(tc.beta1, tc.beta2), eps=tc.eps, fused=False, foreach=False)
    for p, where, _ in groups:
        opt.state[p] = {"step": torch.tensor(float(steps_done)), "exp_avg": m[where].clone(),
                        "exp_avg_sq": v[where].clone()}
    if tc.grad_clip:
        torch.nn.utils.clip_grad_norm_([p for p, _, _ in groups], tc.grad_clip)
    opt.step()
    out = state.clone()
    for p, where, _ in groups:
        out[:n][where] = p.detach()
        out[n:2 * n][where] = opt.state[p]["exp_avg"]
        out[2 * n:][where] = opt.state[p]["exp_avg_sq"]
    return out


@pytest.mark.parametrize("header_step", [0, 3, 40])
def test_the_update_from_a_checkpoint_of_step_s_is_adamw_with_the_bias_correction_of_step_s_plus_1(header_step):
    cfg = configload.load(preset="andrea-tiny")
    trainer = Trainer(cfg, torch.device("cpu"), kernels="torch")
    state = moments_after(trainer, header_step, seed=header_step)
    trainer.load(state)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=gen)
    out = trainer.train_step(header_step, x, torch.roll(x, -1, dims=1))
    assert out.step == header_step + 1  # the header step of the checkpoint this state becomes
    assert out.lr == pytest.approx(lr_at(header_step, cfg.train))
    grad = trainer.state.grad.clone()  # the pre-clip gradient the update used (clipping works on a copy)
    expected = torch_adamw(trainer, state, grad, header_step)
    n = trainer.n
    got = trainer.state.buffer
    # Compare the change, not the weights: the update is ~lr per element, and a bias correction of the wrong step
    # changes it by 1 % (step 40: 41 for 40) to 30 % (step 3) of its largest element. The bound is 1e-3 of that:
    # measured, the two implementations differ by at most 2.5e-5 of it (the rounding of w + Δw at |w| ~ 1, the
    # LayerNorm gains, seen through the subtraction), so the bound has 40x room and the bug 10x beyond it.
    for region, name in ((slice(0, n), "w"), (slice(n, 2 * n), "m"), (slice(2 * n, 3 * n), "v")):
        change, want = got[region] - state[region], expected[region] - state[region]
        scale = want.abs().max()
        assert scale > 0, name
        assert (change - want).abs().max() <= 1e-3 * scale, (name, float((change - want).abs().max()), float(scale))


@pytest.mark.parametrize("optimizer", ["muon", "adamw"])
def test_the_guards_lr_scale_reaches_every_update_muons_matrices_included(optimizer):
    """The guard's remedy (control/guard/decisions.py) multiplies the learning rate of the optimizer that diverged:
    at lr_scale 0.5 the same step from the same state moves Muon's matrices (train.muon_lr's) and AdamW's
    parameters half as far. A scale applied to train.lr's AdamW alone would leave Muon's change unchanged."""
    from andrea.optim.muon import matrix_spans
    cfg = configload.load(preset="andrea-tiny", overrides=[f"train.optimizer={optimizer}"])
    changes = []
    for scale in (1.0, 0.5):
        trainer = Trainer(cfg, torch.device("cpu"), kernels="torch")
        state = moments_after(trainer, 40, seed=2)
        trainer.load(state)
        trainer.lr_scale = scale
        x = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
        out = trainer.train_step(40, x, torch.roll(x, -1, dims=1))
        assert out.lr == pytest.approx(lr_at(40, cfg.train) * scale)  # the rate the ledger records
        changes.append(trainer.state.buffer[:trainer.n] - state[:trainer.n])
    full, half = changes
    spans = matrix_spans(trainer.layout)
    muon = torch.zeros(trainer.n, dtype=torch.bool)
    for lo, numel in spans:
        muon[lo:lo + numel] = True
    parts = (("muon", muon), ("adamw", ~muon)) if optimizer == "muon" else (("adamw", torch.ones_like(muon)),)
    for name, where in parts:
        # Muon's change is lr_mu·(O + wd·w) and O does not depend on the rate, so it halves exactly; AdamW's first
        # update from these moments likewise (m and v of step 40 are the same in both runs)
        assert full[where].abs().max() > 0, name
        assert (half[where] - 0.5 * full[where]).abs().max() <= 1e-3 * full[where].abs().max(), name
