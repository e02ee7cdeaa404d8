"""Muon's elementwise parts (andrea/kernels/muon.py): the references against their formulas in fp64
(torch.optim.Muon's momentum, Nesterov blend and decoupled decay)."""

import pytest
import torch

from andrea.kernels import muon_apply_reference, muon_momentum_reference


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_reference(nesterov):
    gen = torch.Generator().manual_seed(0)
    grad, momentum = torch.randn(7, 123, generator=gen), torch.randn(7, 123, generator=gen)
    g64, m64 = grad.double(), momentum.double()
    update = muon_momentum_reference(grad, momentum, 0.95, nesterov)
    want_m = 0.95 * m64 + 0.05 * g64
    torch.testing.assert_close(momentum.double(), want_m)  # updated in place
    torch.testing.assert_close(update.double(), 0.05 * g64 + 0.95 * want_m if nesterov else want_m)
    assert (update is momentum) != nesterov


def test_apply_reference():
    gen = torch.Generator().manual_seed(1)
    w, update = torch.randn(431, generator=gen), torch.randn(431, generator=gen)
    want = w.double() * (1 - 0.02 * 0.1) - 0.02 * update.double()
    out = muon_apply_reference(w, update, lr=0.02, weight_decay=0.1)
    assert out is w
    torch.testing.assert_close(w.double(), want)
