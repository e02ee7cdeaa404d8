"""Muon's elementwise parts (andrea/kernels/muon_update.py): the fused kernels against the references, and the references
against their formulas in fp64 (torch.optim.Muon's momentum, Nesterov blend and decoupled decay). On the CPU under
the Triton interpreter and on CUDA with compiled kernels (tests/unit/kernels/conftest.py decides which).

Sizes are odd: 1 element, a (7, 123) matrix (one partial program), 4097 (a one-element tail program after the
interpreter's 4096 block; on CUDA four full 1024 blocks and a tail) and, on CUDA, a (1000, 1003) matrix. Three steps
each, so the momentum carries what the kernel wrote into the next step.
"""

import pytest
import torch

from andrea.kernels import muon_apply, muon_apply_reference, muon_momentum, muon_momentum_reference
from tests.unit.kernels.conftest import ON_CPU, ON_CUDA

# (dtype of the update, atol in fp32 ulps of the largest |reference| value, rtol): the state is fp32. The kernels
# evaluate the references' formulas op for op (torch's two-sided lerp, w·(1 − lr·wd) − lr·u); torch's CPU kernels
# contract some of them into FMAs and the GPU contracts others (launch.FP_FUSION), so a result may sit an ulp or two
# of its operands away: 4 ulps of the buffer's largest value covers it (measured under the interpreter: 2), and
# covers the values near 0 that a lerp of mixed signs leaves, whose error is ulps of the operands, not of the result.
# A wrong beta, a dropped decay or a Nesterov blend from the old momentum is off by ~1e-2 of the values.
TOLERANCES = [(torch.float32, 4, 0.0), (torch.bfloat16, 4, 0.0), (torch.float16, 4, 0.0)]
ULPS = {dtype: ulps for dtype, ulps, _ in TOLERANCES}
SIZES = [pytest.param(d, s, marks=m, id=f"{d}-{'x'.join(map(str, s))}")
         for d, m in (("cpu", ON_CPU), ("cuda", ON_CUDA)) for s in [(1,), (7, 123), (4097,)]]
SIZES += [pytest.param("cuda", (1000, 1003), marks=ON_CUDA, id="cuda-1000x1003")]
DEVICES = [pytest.param("cpu", marks=ON_CPU), pytest.param("cuda", marks=ON_CUDA)]
STEPS = 3


def _assert_close(name, got, want, update_dtype=torch.float32):
    bound = ULPS[update_dtype] * torch.finfo(torch.float32).eps * want.abs().max().clamp_min(1e-30).item()
    err = (got - want).abs().max().item()
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e}"


def _grads(shape, seed, device):
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same values on every device
    return [torch.randn(*shape, generator=gen).to(device) for _ in range(STEPS)]


def _momentum_steps(fn, shape, beta, nesterov, device):
    """The momentum and each step's update after STEPS calls of fn."""
    momentum = torch.zeros(*shape, device=device)
    updates = [fn(g, momentum, beta, nesterov).clone() for g in _grads(shape, 0, device)]
    return momentum, updates


@pytest.mark.parametrize("beta", [0.95, 0.3])  # both sides of torch's two-sided lerp, for each of the two lerps
@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("device,shape", SIZES)
def test_momentum_matches_reference(device, shape, nesterov, beta):
    got_m, got_u = _momentum_steps(muon_momentum, shape, beta, nesterov, device)
    want_m, want_u = _momentum_steps(muon_momentum_reference, shape, beta, nesterov, device)
    _assert_close("momentum", got_m, want_m)
    for step, (got, want) in enumerate(zip(got_u, want_u)):
        _assert_close(f"update {step}", got, want)


@pytest.mark.parametrize("update_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("weight_decay", [0.1, 0.0])
@pytest.mark.parametrize("device,shape", SIZES)
def test_apply_matches_reference(device, shape, weight_decay, update_dtype):
    w0 = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(device)
    got, want = w0.clone(), w0.clone()
    for update in _grads(shape, 2, device):
        assert muon_apply(got, update.to(update_dtype), 0.02, weight_decay) is got
        muon_apply_reference(want, update.to(update_dtype), 0.02, weight_decay)
    _assert_close("w", got, want, update_dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_the_update_is_the_momentum_itself_without_nesterov_and_written_over_grad_with_it(device):
    grad, momentum = torch.randn(7, 123, device=device), torch.zeros(7, 123, device=device)
    assert muon_momentum(grad, momentum, 0.95, nesterov=False) is momentum
    g0 = grad.clone()
    update = muon_momentum(grad, momentum, 0.95, nesterov=True)
    assert update is grad and not torch.equal(grad, g0)  # no buffer the size of the matrices beside the state


@pytest.mark.parametrize("device", DEVICES)
def test_tolerance_catches_a_nesterov_blend_from_the_old_momentum(device):
    def stale(grad, momentum, beta, nesterov):  # blends with the momentum before this step's lerp
        update = grad.lerp(momentum, beta)
        muon_momentum(grad, momentum, beta, nesterov=False)
        return update
    got = _momentum_steps(stale, (7, 123), 0.95, True, device)[1][-1]
    want = _momentum_steps(muon_momentum_reference, (7, 123), 0.95, True, device)[1][-1]
    with pytest.raises(AssertionError):
        _assert_close("update", got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_two_runs_are_bit_identical(device):
    shape = (4097,) if device == "cpu" else (1000, 1003)
    runs = []
    for _ in range(2):
        momentum, updates = _momentum_steps(muon_momentum, shape, 0.95, True, device)
        w = torch.ones(*shape, device=device)
        for u in updates:
            muon_apply(w, u, 0.02, 0.1)
        runs.append((momentum, w))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_rejects_what_it_cannot_read():
    grad, momentum = torch.randn(8, 16), torch.zeros(8, 16)
    with pytest.raises(ValueError, match="contiguous"):
        muon_momentum(grad.t(), momentum.t(), 0.95, True)  # strided views
    with pytest.raises(ValueError):
        muon_momentum(grad.double(), momentum, 0.95, True)
    with pytest.raises(ValueError):
        muon_apply(torch.zeros(8, 16), torch.zeros(16, 8), 0.02, 0.0)  # shapes differ
    with pytest.raises(ValueError):
        muon_apply(torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(8, 16), 0.02, 0.0)  # the weights are fp32


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
