"""Fused cross-entropy (andrea/kernels/cross_entropy.py) against F.cross_entropy: on the CPU under the Triton
interpreter, and on CUDA with compiled kernels when a GPU is present (tests/unit/kernels/conftest.py decides which).

Same acceptance rule as attention: against fp64 torch, the kernel's error is at most twice fp32 torch's error on
the same device (plus a floor), for every reduction: "mean", "sum", and "none" (per-row losses, the trainer's,
backpropagated with a different upstream gradient on every row so a wrong row-to-gradient pairing shows).
Odd shapes: V = 1 (loss 0), 17 (one partial chunk), 2500 (three 1024-wide chunks under the interpreter, ragged
tail; one partial 4096-wide chunk on CUDA); on CUDA also the presets' vocabularies, 8192 (two full chunks) and
22528 (five and a half). Half-precision logits (fp16; bf16 on CUDA) give fp32 losses and a gradient in their dtype.
"""

import pytest
import torch

from andrea.kernels.cross_entropy import cross_entropy, cross_entropy_reference
from tests.unit.kernels.conftest import DEVICES, ON_CPU, ON_CUDA

# The reference's fp32 error can be exactly 0 (V = 1: loss and gradient are exactly 0; a lucky sum). The floor is
# 1e-6 relative to the largest exact value (at least 1): ~8 fp32 ulps, so an O(300) "sum" may differ from torch's
# summation order by a few ulps, yet far below any real bug (a dropped chunk or a wrong target is off by >1e-3).
REL_FLOOR = 1e-6


def _loss_and_grad(fn, logits, targets, dtype, reduction="mean"):
    x = logits.detach().to(dtype).clone().requires_grad_()
    loss = fn(x, targets, reduction=reduction)
    # "none": row i's loss weighted by 1 + i/N (drawn from the shape, identical for every fn and dtype)
    upstream = 1 + torch.arange(len(targets), device=x.device, dtype=torch.float32) / len(targets)
    loss.backward(upstream.to(loss.dtype) if reduction == "none" else None)
    return loss.detach().double(), x.grad.double()


def _case(N, V, seed=0, ignored=(), device="cpu"):
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same values on every device
    logits = 3 * torch.randn(N, V, generator=gen, dtype=torch.float64)  # spread: softmax far from uniform
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[list(ignored)] = -100
    return logits.to(device), targets.to(device)


SHAPES = [(1, 1, ()), (7, 17, (2, 5)), (37, 2500, (0,)), (5, 1024, ())]
CASES = [pytest.param("cpu", *shape, marks=ON_CPU) for shape in SHAPES] + [
    pytest.param("cuda", *shape, marks=ON_CUDA) for shape in SHAPES + [(33, 8192, ()), (64, 22528, (5, 63))]]


@pytest.mark.parametrize("reduction", ["mean", "none", "sum"])
@pytest.mark.parametrize("device,N,V,ignored", CASES)
def test_matches_fp64_reference(device, N, V, ignored, reduction):
    logits, targets = _case(N, V, ignored=ignored, device=device)
    truth = _loss_and_grad(cross_entropy_reference, logits, targets, torch.float64, reduction)
    plain = _loss_and_grad(cross_entropy_reference, logits, targets, torch.float32, reduction)
    kernel = _loss_and_grad(cross_entropy, logits, targets, torch.float32, reduction)
    assert kernel[0].shape == truth[0].shape
    for name, got, ref, exact in zip(("loss", "dlogits"), kernel, plain, truth):
        kernel_err, torch_err = (got - exact).abs().max().item(), (ref - exact).abs().max().item()
        floor = REL_FLOOR * max(1.0, exact.abs().max().item())
        assert kernel_err <= 2 * torch_err + floor, f"{name}: kernel {kernel_err:.3e} vs torch {torch_err:.3e}"
    assert torch.all(kernel[1][list(ignored)] == 0)


LOW_PRECISION = [pytest.param("cpu", torch.float16, marks=ON_CPU), pytest.param("cuda", torch.float16, marks=ON_CUDA),
                 pytest.param("cuda", torch.bfloat16, marks=ON_CUDA)]  # the interpreter has no bf16 arithmetic


@pytest.mark.parametrize("device,dtype", LOW_PRECISION)
def test_half_logits_are_read_as_they_are(device, dtype):
    """The trainer's case on a GPU: bf16 logits from autocast, fp32 per-row losses, a gradient in the logits' dtype."""
    logits, targets = _case(7, 300, seed=1, device=device)
    x = logits.to(dtype).requires_grad_()
    rows = cross_entropy(x, targets, reduction="none")
    rows.sum().backward()
    assert rows.dtype == torch.float32 and x.grad.dtype == dtype
    ref_rows = cross_entropy_reference(logits.to(dtype), targets, reduction="none")
    ref_grad = _loss_and_grad(cross_entropy_reference, logits, targets, dtype, "sum")[1]
    # Both read the same rounded logits and compute in fp32, so the losses agree to fp32 rounding of an O(10) value
    # (1e-6 relative, a few ulps). The gradients differ only by the final rounding to the logits' dtype: half an
    # ulp of values <= 1 (2**-11 fp16, 2**-8 bf16), so one ulp of tolerance.
    torch.testing.assert_close(rows, ref_rows, rtol=1e-6, atol=1e-6)
    ulp = torch.finfo(dtype).eps
    torch.testing.assert_close(x.grad.double(), ref_grad, rtol=ulp, atol=ulp)


def test_rejects_an_unknown_reduction():
    logits, targets = _case(2, 5)
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits.float(), targets, reduction="avg")


@pytest.mark.parametrize("device", DEVICES)
def test_two_runs_are_bit_identical(device):
    logits, targets = _case(37, 2500, seed=2, ignored=(3,), device=device)
    first, second = (_loss_and_grad(cross_entropy, logits, targets, torch.float32) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
