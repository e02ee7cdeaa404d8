"""AdamW (andrea/kernels/adamw.py): the Triton kernel and the plain-torch reference against torch.optim.AdamW,
on the CPU under the Triton interpreter and on CUDA with the compiled kernel (tests/kernels/conftest.py decides).

The flat-buffer update with a decay mask must equal torch's AdamW over two parameter groups (masked-in params
with weight decay, the rest with weight_decay=0) with clip_grad_norm_ before every step, on the same device.
Lengths are odd (1, 1000, 4097: one element, one partial program, a one-element tail program under the
interpreter's 4096 block; on CUDA's 1024 block, 4097 is four full programs and a one-element tail, and 1,000,003
adds ~1000 programs).
"""

import pytest
import torch

from andrea.kernels import adamw_reference, adamw_step
from tests.kernels.conftest import DEVICES, ON_CPU, ON_CUDA

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
MAX_GRAD_NORM = 1.0
STEPS = 5


def _grads(n, seed=0):
    # Alternating scales: even steps have norm ~10 * sqrt(n) (clipped), odd ones ~0.1 (not clipped), so both
    # values of the clip factor are exercised.
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=gen) * (10.0 if step % 2 == 0 else 0.1 / n ** 0.5) for step in range(STEPS)]


def _decay_mask(n):
    return torch.arange(n) % 3 != 0  # a third of the params (think biases, norms) are not decayed


def _torch_adamw(w0, grads, mask, beta1=HYPER["beta1"]):
    """w, m, v after STEPS steps of torch.optim.AdamW on w0's device, scattered back into flat buffers.

    fused=False: torch's own unfused implementation (the for-loop on CPU, foreach on CUDA) is the reference;
    its fused CUDA kernel is what bench/kernels.py races against, not what defines the semantics."""
    decayed = w0[mask].clone().requires_grad_()
    plain = w0[~mask].clone().requires_grad_()
    opt = torch.optim.AdamW([{"params": [decayed], "weight_decay": HYPER["weight_decay"]},
                             {"params": [plain], "weight_decay": 0.0}],
                            lr=HYPER["lr"], betas=(beta1, HYPER["beta2"]), eps=HYPER["eps"], fused=False)
    for g in grads:
        decayed.grad, plain.grad = g[mask].clone(), g[~mask].clone()
        torch.nn.utils.clip_grad_norm_([decayed, plain], MAX_GRAD_NORM)
        opt.step()
    flat = []
    for key in (None, "exp_avg", "exp_avg_sq"):
        out = torch.empty_like(w0)
        for param, where in ((decayed, mask), (plain, ~mask)):
            out[where] = (param if key is None else opt.state[param][key]).detach()
        flat.append(out)
    return flat


def _flat_adamw(update, w0, grads, mask, beta1=HYPER["beta1"]):
    """w, m, v after STEPS calls of `update` on views into one flat [w | m | v] buffer, as the trainer holds them."""
    n = w0.numel()
    state = torch.zeros(3 * n, device=w0.device)
    w, m, v = state[:n], state[n:2 * n], state[2 * n:]
    w.copy_(w0)
    norms = []
    for step, g in enumerate(grads, start=1):
        hyper = {**HYPER, "beta1": beta1}
        norms.append(update(w, g.clone(), m, v, step=step, decay_mask=mask, max_grad_norm=MAX_GRAD_NORM, **hyper))
    return [w, m, v], norms


def _assert_close(name, got, want, ulps):
    """|got - want| <= ulps fp32 ulps of the buffer's largest element. Scaled to the buffer, not per element:
    m is a lerp of gradients of mixed sign, so cancellation leaves entries near 0 whose error is ulps of the
    operands (the buffer's scale), not of the result."""
    bound = ulps * torch.finfo(torch.float32).eps * want.abs().max().clamp_min(1e-30).item()
    err = (got - want).abs().max().item()
    assert err <= bound, f"{name}: max error {err:.3e} > {bound:.3e} ({ulps} ulps of max |{name}|)"


# vs torch.optim.AdamW: torch's clip_grad_norm_ combines per-tensor norms (another rounding order than our single
# flat norm, so the clip factor may differ by an ulp) and its CPU kernels vectorise differently. 8 ulps: 5 steps,
# each a handful of roundings, with no amplification (Adam's update is a ratio of two quantities that both scale
# with the clip factor). Measured: <= 4.2 ulps (v) on these seeds.
TORCH_ULPS = 8


SIZES = [pytest.param("cpu", n, marks=ON_CPU) for n in (1, 1000, 4097)] + [
    pytest.param("cuda", n, marks=ON_CUDA) for n in (1, 1000, 4097, 1_000_003)]


@pytest.mark.parametrize("update", [adamw_step, adamw_reference], ids=["kernel", "reference"])
@pytest.mark.parametrize("device,n", SIZES)
@pytest.mark.parametrize("beta1", [0.9, 0.3])  # 0.3: lerp weight 0.7 takes torch's other lerp formula
def test_matches_torch_optim_adamw(update, device, n, beta1):
    w0 = torch.randn(n, generator=torch.Generator().manual_seed(n)).to(device)  # drawn on the CPU: same values
    grads, mask = [g.to(device) for g in _grads(n)], _decay_mask(n).to(device)
    ours, _ = _flat_adamw(update, w0, grads, mask, beta1)
    theirs = _torch_adamw(w0, grads, mask, beta1)
    for name, a, b in zip("wmv", ours, theirs):
        _assert_close(name, a, b, TORCH_ULPS)


@pytest.mark.parametrize("n", [1000, 4097])
@pytest.mark.parametrize("mask_on,clip", [(True, MAX_GRAD_NORM), (False, None)])
@pytest.mark.parametrize("device", DEVICES)
def test_kernel_matches_reference(device, n, mask_on, clip):
    # Same norm code, same op order: only per-op rounding (FMA contraction, vectorisation) may differ.
    w0 = torch.randn(n, generator=torch.Generator().manual_seed(7)).to(device)
    mask = _decay_mask(n).to(device) if mask_on else None
    states, norm_lists = [], []
    for update in (adamw_step, adamw_reference):
        w, m, v = w0.clone(), torch.zeros(n, device=device), torch.zeros(n, device=device)
        norms = [update(w, g.to(device), m, v, step=s, decay_mask=mask, max_grad_norm=clip, **HYPER)
                 for s, g in enumerate(_grads(n, seed=1), start=1)]
        states.append((w, m, v))
        norm_lists.append(torch.stack(norms))
    assert torch.equal(norm_lists[0], norm_lists[1])  # the norm is literally the same computation
    for name, a, b in zip("wmv", *states):
        _assert_close(name, a, b, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_two_runs_are_bit_identical(device):
    w0, mask = torch.randn(4097).to(device), _decay_mask(4097).to(device)
    grads = [g.to(device) for g in _grads(4097)]
    (a, na), (b, nb) = (_flat_adamw(adamw_step, w0, grads, mask) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(a + na, b + nb))


@pytest.mark.parametrize("device", DEVICES)
def test_returns_pre_clip_norm_as_device_tensor(device):
    g = torch.full((10,), 3.0, device=device)
    zeros = [torch.zeros(10, device=device) for _ in range(3)]
    norm = adamw_step(zeros[0], g, zeros[1], zeros[2], step=1, max_grad_norm=1.0, **HYPER)
    assert norm.dim() == 0 and norm.device == g.device
    assert norm.item() == pytest.approx(3.0 * 10 ** 0.5)
    assert torch.equal(g, torch.full((10,), 3.0, device=device))  # the caller's gradient is not clipped in place


def test_rejects_bad_buffers():
    x = torch.zeros(8)
    with pytest.raises(ValueError):
        adamw_step(x, x.double(), x, x, step=1, **HYPER)
    with pytest.raises(ValueError):
        adamw_step(x, x, x, torch.zeros(16)[::2], step=1, **HYPER)
    with pytest.raises(ValueError):
        adamw_step(x, x, x, x, step=1, decay_mask=torch.ones(8), **HYPER)
