"""Rotary embeddings (andrea/kernels/rotary.py): the kernel against rotary_reference, output and dx, on the CPU under
the Triton interpreter and on CUDA with compiled kernels (tests/unit/kernels/conftest.py decides which); the tables
and the reference against the half-split convention a stock `transformers` Llama/Qwen3 class applies
(apply_rotary_pos_emb with rotate_half).

x arrives as the model makes it: a (B, H, T, D) view of a (B, T, H, D) tensor (strided; the kernel reads it in
place). Odd shapes: T 1 / 7 / 123 / 431 (32-position tiles under the interpreter: ragged last tiles), D 16 / 48 / 64
/ 128 (48: a half of 24 in a 32-wide masked block).
"""

import pytest
import torch

from andrea.kernels import rotary, rotary_reference, rotary_tables
from andrea.kernels.rotary import rotary_config
from tests.unit.kernels.conftest import ON_CPU, ON_CUDA

FP32, FP16, BF16 = torch.float32, torch.float16, torch.bfloat16
# (dtype, atol as a fraction of the largest |reference| value, rtol), for the output and dx alike. Both sides compute
# x1·cos − x2·sin (and its twin) in fp32 and round once: the interpreter's numpy gives the reference's bits; the GPU
# contracts one product into an FMA, which moves a result by at most an fp32 ulp of the larger product (~2**-23 of
# the largest |x|: the atol for results that cancel toward 0) and ~1 ulp of a result that does not (rtol 1e-6, ~8
# ulps). fp16/bf16: fp32 values that close round to the same or adjacent values: one ulp of the dtype (eps) relative.
# A real bug is far outside: the interleaved convention, a position off by one or a wrong sign moves values by O(1)
# (test_tolerance_catches_a_shifted_position).
TOLERANCES = [(FP32, 1e-6, 1e-6), (FP16, 1e-6, 2.0 ** -10), (BF16, 1e-6, 2.0 ** -7)]
TOL = {dtype: (atol, rtol) for dtype, atol, rtol in TOLERANCES}
# (device, dtype): the interpreter has no bf16 arithmetic (it truncates where CUDA rounds), so bf16 runs on CUDA only.
CASES = [pytest.param("cpu", FP32, marks=ON_CPU, id="cpu-fp32"), pytest.param("cpu", FP16, marks=ON_CPU, id="cpu-fp16"),
         *(pytest.param("cuda", d, marks=ON_CUDA, id=f"cuda-{str(d)[6:]}") for d in (FP32, FP16, BF16))]
SHAPES = [(1, 1, 1, 16), (2, 3, 7, 64), (1, 2, 123, 48), (1, 1, 431, 128)]  # (B, H, T, D)
# GPU only: andrea-12m's and andrea-120m's q (batch, heads, block size, head dim 64), and D = 128 at a ragged T.
CUDA_SHAPES = [(32, 5, 256, 64), (16, 12, 1024, 64), (2, 3, 333, 128)]


def _shape_id(shape):
    return "x".join(map(str, shape))


def _inputs(B, H, T, D, seed=0, device="cpu"):
    """x as a strided (B, H, T, D) view of a (B, T, H, D) tensor, dy (B, H, T, D), and the tables; on device."""
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same values on every device
    x = torch.randn(B, T, H, D, generator=gen).to(device).transpose(1, 2)
    dy = torch.randn(B, H, T, D, generator=gen).to(device)
    return x, dy, *rotary_tables(T, D, 10000.0, device)


def _run(fn, x, dy, cos, sin, dtype):
    """(out, dx) of fn on x cast to dtype (keeping its strides), backpropagating dy cast to dtype."""
    leaf = x.detach().to(dtype).requires_grad_()
    out = fn(leaf, cos, sin)
    out.backward(dy.to(dtype))
    return out.detach(), leaf.grad


def _mismatches(got, want, dtype):
    atol, rtol = TOL[dtype]
    bad = []
    for name, g, w in zip(("out", "dx"), got, want):
        assert g.dtype == w.dtype == dtype and g.shape == w.shape, (name, g.dtype, w.dtype)
        g, w = g.double(), w.double()
        if not torch.allclose(g, w, rtol=rtol, atol=atol * w.abs().max().item()):
            bad.append(f"{name}: max error {(g - w).abs().max().item():.3e}")
    return bad


@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
@pytest.mark.parametrize("device,dtype", CASES)
def test_matches_reference(device, dtype, shape):
    args = _inputs(*shape, device=device)
    assert not args[0].is_contiguous() or shape[1] == 1
    assert _mismatches(_run(rotary, *args, dtype), _run(rotary_reference, *args, dtype), dtype) == []


@ON_CUDA
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", [FP32, FP16, BF16], ids=["fp32", "fp16", "bf16"])
def test_trainer_shapes_match_reference_on_cuda(dtype, shape):
    args = _inputs(*shape, device="cuda")
    assert _mismatches(_run(rotary, *args, dtype), _run(rotary_reference, *args, dtype), dtype) == []


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=ON_CPU), pytest.param("cuda", marks=ON_CUDA)])
def test_the_gradient_is_the_rotation_by_minus_theta_and_preserves_norms(device):
    x, dy, cos, sin = _inputs(1, 2, 123, 48, device=device)
    out, dx = _run(rotary, x, dy, cos, sin, FP32)
    torch.testing.assert_close(dx, rotary_reference(dy, cos, -sin), rtol=1e-6, atol=1e-6)  # fp32, O(1) values
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-5, atol=0)  # a rotation: |out| = |x|


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=ON_CPU), pytest.param("cuda", marks=ON_CUDA)])
def test_the_gradient_comes_back_in_the_projections_layout(device):
    # q is a (B, H, T, D) view of the (B, T, H, D) projection: dx is written in that memory order, so the transpose's
    # backward hands QK-norm a contiguous gradient (no copy); the forward's output is contiguous for attention.
    base = torch.randn(2, 7, 3, 16, device=device).requires_grad_()  # (B, T, H, D)
    cos, sin = rotary_tables(7, 16, 10000.0, device)
    out = rotary(base.transpose(1, 2), cos, sin)
    dy = torch.randn_like(out)
    (got,) = torch.autograd.grad(out, base, dy)
    (want,) = torch.autograd.grad(rotary_reference(base.transpose(1, 2), cos, sin), base, dy)
    assert out.is_contiguous() and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # fp32, O(1) values


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=ON_CPU), pytest.param("cuda", marks=ON_CUDA)])
def test_tolerance_catches_a_shifted_position(device):
    x, dy, cos, sin = _inputs(1, 2, 123, 48, device=device)
    cos1, sin1 = (t.roll(1, dims=0).contiguous() for t in (cos, sin))  # position t rotated as t - 1
    bad = _mismatches(_run(rotary, x, dy, cos1, sin1, FP32), _run(rotary_reference, x, dy, cos, sin, FP32), FP32)
    assert [b.split(":")[0] for b in bad] == ["out", "dx"]


@pytest.mark.parametrize("device,dtype", [p for p in CASES if p.id != "cpu-fp16"])
def test_two_runs_are_bit_identical(device, dtype):
    args = _inputs(*((1, 2, 123, 48) if device == "cpu" else (16, 12, 1024, 64)), seed=3, device=device)
    first, second = (_run(rotary, *args, dtype) for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_launch_config_is_a_pinned_function_of_the_head_dim():
    assert rotary_config(48, "cpu") == (32, 32, 1)
    for D in (16, 48, 64, 128, 256):
        block_t, block_half, _ = rotary_config(D, "cuda")
        assert block_half >= D // 2 and block_half & (block_half - 1) == 0 and block_t * block_half == 2048


def test_rejects_what_it_cannot_read():
    cos, sin = rotary_tables(7, 16, 10000.0)
    with pytest.raises(ValueError):
        rotary(torch.randn(1, 1, 7, 15), cos, sin)  # odd D
    with pytest.raises(ValueError):
        rotary(torch.randn(1, 1, 8, 16), cos, sin)  # tables for another T
    with pytest.raises(ValueError):
        rotary(torch.randn(1, 1, 7, 16), cos.double(), sin.double())
    with pytest.raises(ValueError):
        rotary(torch.randn(1, 1, 7, 16), cos.t().contiguous().t(), sin)  # a strided (7, 8) table


def test_tables_are_positions_times_inverse_frequencies():
    cos, sin = rotary_tables(7, 16, 10000.0)
    assert cos.shape == sin.shape == (7, 8) and cos.dtype == sin.dtype == torch.float32
    angle = torch.arange(7, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, 16, 2) / 16)[None, :]
    torch.testing.assert_close(cos.double(), angle.cos(), atol=1e-6, rtol=0)  # fp32 angles: ~1 ulp of t ≤ 6
    torch.testing.assert_close(sin.double(), angle.sin(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (2, 3, 7, 64), (1, 2, 123, 32)], ids=_shape_id)
def test_reference_is_hf_rotate_half(shape):
    # imported here: the GPU image that runs this file's CUDA cases (bench/gpu_check.sh) need not have transformers
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    B, H, T, D = shape
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(*shape, generator=gen) for _ in range(2))
    cos, sin = rotary_tables(T, D, 10000.0)
    # HF's tables repeat the D/2 angles over both halves, (B, T, D), and unsqueeze the head dim.
    hf_q, hf_k = llama.apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])
    torch.testing.assert_close(rotary_reference(q, cos, sin), hf_q, atol=0, rtol=0)
    torch.testing.assert_close(rotary_reference(k, cos, sin), hf_k, atol=0, rtol=0)
