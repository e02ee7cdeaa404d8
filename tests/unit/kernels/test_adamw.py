"""AdamW (andrea/kernels/adamw.py): the Triton kernel and the plain-torch reference against torch.optim.AdamW,
on the CPU under the Triton interpreter and on CUDA with the compiled kernel (tests/unit/kernels/conftest.py decides).

The flat-buffer update with a decay mask must equal torch's AdamW over two parameter groups (masked-in params
with weight decay, the rest with weight_decay=0) with clip_grad_norm_ before every step, on the same device.
Lengths are odd (1, 1000, 4097: one element, one partial program, a one-element tail program under the
interpreter's 4096 block; on CUDA's 1024 block, 4097 is four full programs and a one-element tail, and 1,000,003
adds ~1000 programs).
"""

import math

import pytest
import torch

from andrea.kernels import adamw as adamw_module, adamw_reference, adamw_step
from tests.unit.kernels.conftest import DEVICES, ON_CPU, ON_CUDA

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


# The CPU reference's fast paths (slices, a clip factor of exactly 1 skipped, per-run decay from a cached mask plan,
# the bias-correction division skipped once it is 1) must change no bit. The yardstick is the update written out
# once over whole tensors, taking every pass: g * coef, w * (a masked factor tensor), v.sqrt() / bc2 + eps.


def _plain_reference(w, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, decay_mask=None, max_grad_norm=None):
    norm = torch.linalg.vector_norm(g, 2.0, dtype=torch.float32)
    if max_grad_norm:
        g = g * torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)
    if weight_decay:
        mask = torch.ones_like(w, dtype=torch.bool) if decay_mask is None else decay_mask
        w.mul_(torch.ones_like(w).masked_fill_(mask, 1.0 - lr * weight_decay))
    m.lerp_(g, 1.0 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    w.addcdiv_(m, v.sqrt().div_(math.sqrt(1.0 - beta2 ** step)).add_(eps), value=-lr / (1.0 - beta1 ** step))
    return norm


def _run_bits(update, n, mask, clip, hyper, steps=(1, 2, 1000), seed=3):
    """w, m, v and the norms after `steps` (1000: beta2 ** step < 2 ** -53, so the bias correction is exactly 1)."""
    gen = torch.Generator().manual_seed(seed)
    w, m, v = torch.randn(n, generator=gen), torch.zeros(n), torch.zeros(n)
    norms = []
    for i, step in enumerate(steps):
        g = torch.randn(n, generator=gen) * (10.0 if i % 2 == 0 else 1e-4)  # clipped, then not (for a small clip)
        g0 = g.clone()
        norms.append(update(w, g, m, v, step=step, decay_mask=mask() if callable(mask) else mask, max_grad_norm=clip,
                            **hyper))
        assert torch.equal(g, g0)  # the caller's gradient is never clipped in place
    return [w, m, v, torch.stack(norms)]


def _few_runs_mask(n, chunk):
    """Mixed slices holding a few runs (the scalar-per-run path), a slice of many short runs (the masked multiply),
    whole slices in and out, and runs that end exactly on slice bounds."""
    mask = torch.zeros(n, dtype=torch.bool)
    mask[: chunk // 3] = True
    mask[chunk // 2: chunk + 5] = True
    mask[2 * chunk: 3 * chunk] = torch.arange(chunk) % 3 != 0
    mask[4 * chunk:] = True
    mask[4 * chunk + 7: 4 * chunk + 40] = False
    return mask


@pytest.fixture
def one_thread():
    # Whole-tensor ops split across threads where the slices would not: torch's vectorised kernels and their scalar
    # tails (another rounding for lerp's fused multiply-add) then cover other elements. One thread, one split.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("clip", [None, 1e-3, 1e30], ids=["no-clip", "clip-active", "clip-factor-1"])
@pytest.mark.parametrize("mask_kind", ["none", "few-runs", "mod3", "all", "nothing"])
@pytest.mark.parametrize("hyper", [HYPER, {**HYPER, "weight_decay": 0.0}, {**HYPER, "lr": 0.0}],
                         ids=["decay", "no-decay", "lr-0"])
def test_reference_fast_paths_are_bit_identical_to_the_plain_update(one_thread, monkeypatch, clip, mask_kind, hyper):
    chunk = 1024  # 5 full slices and a partial one; a multiple of every CPU vector width, as REFERENCE_CHUNK is
    monkeypatch.setattr(adamw_module, "REFERENCE_CHUNK", chunk)
    n = 5 * chunk + 37
    mask = {"none": None, "few-runs": _few_runs_mask(n, chunk), "mod3": _decay_mask(n),
            "all": torch.ones(n, dtype=torch.bool), "nothing": torch.zeros(n, dtype=torch.bool)}[mask_kind]
    ours = _run_bits(adamw_reference, n, mask, clip, hyper)
    plain = _run_bits(_plain_reference, n, mask, clip, hyper)
    for name, a, b in zip(["w", "m", "v", "norm"], ours, plain):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("clip", [1e-3, 1e30], ids=["clip-active", "clip-factor-1"])
def test_reference_at_full_slice_size_is_bit_identical_to_the_plain_update(one_thread, clip):
    n = 5 * adamw_module.REFERENCE_CHUNK + 37  # ~1.3M: the slicing that ships, no monkeypatch
    mask = _few_runs_mask(n, adamw_module.REFERENCE_CHUNK)
    ours = _run_bits(adamw_reference, n, mask, clip, HYPER, steps=(1, 1000))
    plain = _run_bits(_plain_reference, n, mask, clip, HYPER, steps=(1, 1000))
    for name, a, b in zip(["w", "m", "v", "norm"], ours, plain):
        assert torch.equal(a, b), name


def test_reference_mask_plan_cache_hits_and_never_goes_stale(one_thread, monkeypatch):
    chunk = 1024
    monkeypatch.setattr(adamw_module, "REFERENCE_CHUNK", chunk)
    n = 5 * chunk + 37
    mask = _few_runs_mask(n, chunk)
    plain = _run_bits(_plain_reference, n, mask, MAX_GRAD_NORM, HYPER)
    cached = _run_bits(adamw_reference, n, mask, MAX_GRAD_NORM, HYPER)  # one mask object: planned once, then hits
    assert adamw_module._decay_plans(mask, chunk) is adamw_module._decay_plans(mask, chunk)
    fresh = _run_bits(adamw_reference, n, mask.clone, MAX_GRAD_NORM, HYPER)  # a new mask object every step
    for name, a, b, c in zip(["w", "m", "v", "norm"], cached, fresh, plain):
        assert torch.equal(a, c) and torch.equal(b, c), name
    # An in-place change bumps the mask's version counter: the next call plans again instead of reusing stale runs.
    before = adamw_module._decay_plans(mask, chunk)
    mask[100:3000] = ~mask[100:3000]
    assert adamw_module._decay_plans(mask, chunk) != before
    flipped = _run_bits(adamw_reference, n, mask, MAX_GRAD_NORM, HYPER)
    assert all(torch.equal(a, b) for a, b in zip(flipped, _run_bits(_plain_reference, n, mask, MAX_GRAD_NORM, HYPER)))


def test_reference_reads_nothing_back_off_the_cpu():
    # Meta tensors hold no data: any .item() or bool() on the clip factor or the mask would raise. On a GPU, that
    # read would be a host sync per step.
    n = 5000
    w, g, m, v = (torch.empty(n, device="meta") for _ in range(4))
    mask = torch.empty(n, dtype=torch.bool, device="meta")
    for clip, decay_mask in [(None, None), (MAX_GRAD_NORM, mask), (1e30, mask)]:
        norm = adamw_reference(w, g, m, v, step=1000, decay_mask=decay_mask, max_grad_norm=clip, **HYPER)
        assert norm.device.type == "meta"
