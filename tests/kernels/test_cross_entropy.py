"""Fused cross-entropy (andrea/kernels/cross_entropy.py) against F.cross_entropy: on the CPU under the Triton
interpreter, and on CUDA with compiled kernels when a GPU is present (tests/kernels/conftest.py decides which).

Same acceptance rule as attention: against fp64 torch, the kernel's error is at most twice fp32 torch's error on
the same device (plus a floor). Odd shapes: V = 1 (loss 0), 17 (one partial chunk), 2500 (three 1024-wide chunks
under the interpreter, ragged tail; one partial 4096-wide chunk on CUDA); on CUDA also the presets' vocabularies,
8192 (two full chunks) and 22528 (five and a half).
"""

import pytest
import torch

from andrea.kernels.cross_entropy import cross_entropy, cross_entropy_reference
from tests.kernels.conftest import DEVICES, ON_CPU, ON_CUDA

# The reference's fp32 error can be exactly 0 (V = 1: loss and gradient are exactly 0); 1e-6 is ~8 ulps of the
# O(1) loss and far below any real bug (a dropped chunk or a wrong target is off by >1e-3).
ABS_FLOOR = 1e-6


def _loss_and_grad(fn, logits, targets, dtype):
    x = logits.detach().to(dtype).clone().requires_grad_()
    loss = fn(x, targets)
    loss.backward()
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


@pytest.mark.parametrize("device,N,V,ignored", CASES)
def test_matches_fp64_reference(device, N, V, ignored):
    logits, targets = _case(N, V, ignored=ignored, device=device)
    truth = _loss_and_grad(cross_entropy_reference, logits, targets, torch.float64)
    plain = _loss_and_grad(cross_entropy_reference, logits, targets, torch.float32)
    kernel = _loss_and_grad(cross_entropy, logits, targets, torch.float32)
    for name, got, ref, exact in zip(("loss", "dlogits"), kernel, plain, truth):
        kernel_err, torch_err = (got - exact).abs().max().item(), (ref - exact).abs().max().item()
        assert kernel_err <= 2 * torch_err + ABS_FLOOR, f"{name}: kernel {kernel_err:.3e} vs torch {torch_err:.3e}"
    assert torch.all(kernel[1][list(ignored)] == 0)


@pytest.mark.parametrize("device", DEVICES)
def test_fp16_logits_give_fp16_gradient(device):
    logits, targets = _case(7, 300, seed=1, device=device)
    loss, grad = _loss_and_grad(cross_entropy, logits, targets, torch.float16)
    ref_loss, ref_grad = _loss_and_grad(cross_entropy_reference, logits, targets, torch.float16)
    # Both read the same fp16 logits and compute in fp32; the gradients differ by fp16 rounding of the output
    # (half an fp16 ulp of values <= 1/N, i.e. < 1e-4) only.
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_two_runs_are_bit_identical(device):
    logits, targets = _case(37, 2500, seed=2, ignored=(3,), device=device)
    first, second = (_loss_and_grad(cross_entropy, logits, targets, torch.float32) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
