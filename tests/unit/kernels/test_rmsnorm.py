"""Parameter-free RMSNorm (andrea/kernels/rmsnorm.py): the kernel against rms_norm_reference, output and dx, on the
CPU under the Triton interpreter and on CUDA with compiled kernels (tests/unit/kernels/conftest.py decides which);
and the reference against torch's own F.rms_norm.

Rows are scaled from 1e-3 to 10 (mean squares 1e-6..1e2), so eps decides the smallest rows' output and dx spans
three decades. Odd shapes: rows 1 / 7 / 123 / 431 (ragged last programs: the interpreter takes 512 // BLOCK rows a
program), C 16 / 48 / 100 / 320 / 768 (48, 100, 320 and 768 leave a masked tail); the model's two uses: the residual
stream (B, T, C) and QK-norm over each head of a strided (B, T, H, D) view.
"""

import pytest
import torch
import torch.nn.functional as F

from andrea.kernels import rms_norm, rms_norm_reference
from andrea.kernels.rmsnorm import MAX_COLUMNS, rms_norm_config
from tests.unit.kernels.conftest import ON_CPU, ON_CUDA

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (dtype, atol as a fraction of the largest |reference| value, rtol), for y and dx alike. The kernel and the reference
# both compute in fp32 and round once to the dtype; their fp32 values differ by the order the C squares are summed in
# and by rsqrt's rounding (measured: 2 fp32 ulps of rstd, carried into every element; the GPU also contracts into
# FMAs). fp32: 1e-6 relative (~8 ulps), and 1e-6 of the largest |dx| absolute for the elements of dx = rstd * (dy -
# x_hat * c) that cancel toward 0 (measured 6e-8). fp16/bf16: fp32 values that agree to that noise round to the same
# or to adjacent values, so one ulp of the dtype (eps: 2**-10, 2**-7) relative, and the same absolute term for the
# cancelled elements whose ulp is finer than fp32 noise. A real bug is far outside: a wrong eps moves the
# smallest rows by ~1e-1 relative (test_tolerance_catches_a_wrong_eps), a dropped dx term by O(1).
TOLERANCES = [(FP32, 1e-6, 1e-6), (FP16, 1e-6, 2.0 ** -10), (BF16, 1e-6, 2.0 ** -7)]
TOL = {dtype: (atol, rtol) for dtype, atol, rtol in TOLERANCES}
# (device, dtype): the interpreter has no bf16 arithmetic (it truncates where CUDA rounds), so bf16 runs on CUDA only.
CASES = [pytest.param("cpu", FP32, marks=ON_CPU, id="cpu-fp32"), pytest.param("cpu", FP16, marks=ON_CPU, id="cpu-fp16"),
         *(pytest.param("cuda", d, marks=ON_CUDA, id=f"cuda-{str(d)[6:]}") for d in (FP32, FP16, BF16))]
SHAPES = [(1, 16), (7, 100), (123, 48), (431, 64), (2, 7, 320), (3, 768)]
# GPU only: andrea-12m's and andrea-120m's residual streams (B * T rows of n_embd), QK-norm at 120m (B * T * H rows of
# the head dim 64), and the widest row. Milliseconds on a GPU, an hour under the interpreter.
CUDA_SHAPES = [(32, 256, 320), (16, 1024, 768), (16, 1024, 12, 64), (5, MAX_COLUMNS)]


def _shape_id(shape):
    return "x".join(map(str, shape))


def _inputs(shape, seed=0, device="cpu"):
    """x with rows scaled 1e-3..10 and dy, fp32, on device."""
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same values on every device
    rows = torch.Size(shape[:-1]).numel()
    scale = torch.logspace(-3, 1, rows).view(*shape[:-1], 1)
    return (torch.randn(*shape, generator=gen) * scale).to(device), torch.randn(*shape, generator=gen).to(device)


def _run(fn, x, dy, dtype, eps=1e-6):
    """(y, dx) of fn on a copy of x cast to dtype, backpropagating dy cast to dtype."""
    leaf = x.detach().to(dtype).clone().requires_grad_()
    y = fn(leaf, eps)
    y.backward(dy.to(dtype))
    return y.detach(), leaf.grad


def _mismatches(got, want, dtype):
    """Names of the outputs (y, dx) outside TOLERANCES[dtype] of the reference's."""
    atol, rtol = TOL[dtype]
    bad = []
    for name, g, w in zip(("y", "dx"), got, want):
        assert g.dtype == w.dtype == dtype, (name, g.dtype, w.dtype)
        g, w = g.double(), w.double()
        if not torch.allclose(g, w, rtol=rtol, atol=atol * w.abs().max().item()):
            bad.append(f"{name}: max error {(g - w).abs().max().item():.3e}")
    return bad


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("device,dtype", CASES)
def test_matches_reference(device, dtype, shape):
    x, dy = _inputs(shape, device=device)
    assert _mismatches(_run(rms_norm, x, dy, dtype), _run(rms_norm_reference, x, dy, dtype), dtype) == []


@ON_CUDA
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", [FP32, FP16, BF16], ids=["fp32", "fp16", "bf16"])
def test_trainer_shapes_match_reference_on_cuda(dtype, shape):
    x, dy = _inputs(shape, device="cuda")
    assert _mismatches(_run(rms_norm, x, dy, dtype), _run(rms_norm_reference, x, dy, dtype), dtype) == []


@pytest.mark.parametrize("device,dtype", CASES)
def test_qk_norm_on_a_strided_head_view(device, dtype):
    # QK-norm: q out of the (B, T, 3C) projection, viewed (B, T, H, D) and normed per head: a strided input.
    B, T, H, D = 2, 7, 3, 32
    gen = torch.Generator().manual_seed(1)
    qkv, dy = torch.randn(B, T, 3 * H * D, generator=gen).to(device), torch.randn(B, T, H, D, generator=gen).to(device)
    results = []
    for fn in (rms_norm, rms_norm_reference):
        leaf = qkv.to(dtype).requires_grad_()
        q = leaf[..., : H * D].view(B, T, H, D)
        assert not q.is_contiguous()
        y = fn(q, 1e-6)
        y.backward(dy.to(dtype))
        results.append((y.detach(), leaf.grad))
    assert _mismatches(*results, dtype) == []


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=ON_CPU), pytest.param("cuda", marks=ON_CUDA)])
def test_tolerance_catches_a_wrong_eps(device):
    x, dy = _inputs((123, 48), device=device)
    wrong_eps = lambda x, eps: rms_norm(x, 10 * eps)
    assert "y" in " ".join(_mismatches(_run(wrong_eps, x, dy, FP32), _run(rms_norm_reference, x, dy, FP32), FP32))


@pytest.mark.parametrize("device,dtype", [p for p in CASES if p.id != "cpu-fp16"])
def test_two_runs_are_bit_identical(device, dtype):
    x, dy = _inputs((123, 48) if device == "cpu" else (16, 1024, 12, 64), seed=3, device=device)
    first, second = (_run(rms_norm, x, dy, dtype) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_launch_config_is_a_pinned_function_of_the_row_length():
    assert rms_norm_config(48, "cpu") == (64, 8, 1)
    for C in (1, 48, 64, 100, 768, MAX_COLUMNS):
        block, rows, num_warps = rms_norm_config(C, "cuda")
        assert block >= C and block & (block - 1) == 0 and rows & (rows - 1) == 0 and block * rows <= 4096
    with pytest.raises(ValueError):
        rms_norm_config(MAX_COLUMNS + 1, "cuda")


def test_rejects_what_it_cannot_read():
    with pytest.raises(ValueError):
        rms_norm(torch.randn(4, MAX_COLUMNS + 1))
    with pytest.raises(ValueError):
        rms_norm(torch.randn(4, 16, dtype=torch.float64))


@pytest.mark.parametrize("dtype", [FP32, BF16, FP16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 16), (7, 100), (2, 5, 320)], ids=_shape_id)
def test_reference_is_torch_rms_norm_in_fp32(shape, dtype):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    want = F.rms_norm(x.float(), (shape[-1],), eps=1e-6).to(dtype)  # fp32 math, rounded once
    got = rms_norm_reference(x, 1e-6)
    assert got.dtype == dtype
    # fp32: the two may sum the squares in different orders (a few ulps; assert_close's fp32 default 1.3e-6 rtol).
    # fp16/bf16: those fp32 ulps vanish in the one final rounding.
    exact = dtype != FP32
    torch.testing.assert_close(got, want, atol=0 if exact else None, rtol=0 if exact else None)
