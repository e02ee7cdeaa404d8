"""Fused attention (andrea/kernels/attention.py) against the plain-torch reference: on the CPU under the Triton
interpreter, and on CUDA with compiled kernels when a GPU is present (tests/unit/kernels/conftest.py decides which).

Acceptance rule (FlashAttention's): against an fp64 ground truth, the kernel's error may be at most twice the error
of the plain-torch computation in the same dtype on the same device, for the output and each of dq, dk, dv. On the
CPU that dtype is fp32 (plus fp16 on two shapes); on CUDA every case runs in fp32, bf16 and fp16.
Shapes are odd on purpose (T = 1, 7, 65, 129 with 16-wide tiles: a single partial tile, ragged tails, several
causal diagonal blocks) and B·H small because the interpreter runs every program in Python. On CUDA the same shapes
meet 64/128-wide tiles (mostly one partial tile); CUDA_SHAPES adds the model's sequence lengths, where the wide
tiles have several causal blocks and ragged tails of their own. The modern GPT's q and k (QK-normed, rotary-embedded)
meet the same rule.
"""

import pytest
import torch

from andrea.kernels import attention, attention_reference, rms_norm_reference, rotary_reference, rotary_tables
from andrea.kernels.attention import AttentionConfig, attention_config
from tests.unit.kernels.conftest import DEVICES, ON_CPU, ON_CUDA

# (B, H, T, D): every T in {1, 7, 65, 129}, every D in {16, 32, 64}, B·H in {1, 2, 3, 4}.
SHAPES = [(1, 1, 1, 16), (1, 2, 7, 32), (3, 1, 7, 64), (2, 1, 65, 16), (1, 2, 65, 64), (2, 2, 129, 32),
          (1, 1, 129, 64)]
# GPU only: ANDREA-12M's T = 256 and ANDREA-120M's T = 1024 at their head dim 64, and D = 128 (the 8-warp config)
# with a ragged T. Seconds on a GPU, hours under the interpreter.
CUDA_SHAPES = [(2, 3, 256, 64), (1, 2, 1024, 64), (1, 2, 333, 128)]

# (device, dtype) of the kernel and of the plain-torch baseline it must stay within 2x of. bf16 runs on CUDA only
# (see test_fp16_matches_fp64_reference for why the interpreter cannot check it).
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
FLASH_CASES = [pytest.param("cpu", torch.float32, marks=ON_CPU, id="cpu-fp32")] + [
    pytest.param("cuda", dtype, marks=ON_CUDA, id=f"cuda-{name}") for name, dtype in DTYPES.items()]

# fp32 errors on O(1) values are a few ulps (~1e-7) and the reference's can be exactly 0 (T = 1: softmax of one
# score is exactly 1), where "2x of 0" would demand bit-equality. 1e-6 is ~8 fp32 ulps at magnitude 1: far below
# any real bug (a wrong mask or a missed tile is off by >1e-2) but above legitimate reassociation noise.
ABS_FLOOR = 1e-6


def _run(fn, q, k, v, do, dtype, **kwargs):
    """(o, dq, dk, dv) of fn on copies of q, k, v cast to dtype (on their device), returned in fp64."""
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
    o = fn(*leaves, **kwargs)
    o.backward(do.to(dtype))
    return [t.detach().double() for t in (o, *(leaf.grad for leaf in leaves))]


def _inputs(B, H, T, D, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same values on every device
    return [torch.randn(B, H, T, D, generator=gen, dtype=torch.float64).to(device) for _ in range(4)]  # q, k, v, dO


def _assert_flash_rule(kernel_fn, B, H, T, D, dtype=torch.float32, device="cpu", modern=False, **kwargs):
    q, k, v, do = _inputs(B, H, T, D, device=device)
    if modern:  # the modern GPT's q and k: QK-normed per head, then rotary-embedded (in fp64, before any rounding)
        cos, sin = (t.double() for t in rotary_tables(T, D, 10000.0, device))
        q, k = (rotary_reference(rms_norm_reference(t), cos, sin) for t in (q, k))
    truth = _run(attention_reference, q, k, v, do, torch.float64, **kwargs)
    plain_torch = _run(attention_reference, q, k, v, do, dtype, **kwargs)
    kernel = _run(kernel_fn, q, k, v, do, dtype, **kwargs)
    for name, got, ref, exact in zip(("o", "dq", "dk", "dv"), kernel, plain_torch, truth):
        kernel_err = (got - exact).abs().max().item()
        torch_err = (ref - exact).abs().max().item()
        assert kernel_err <= 2 * torch_err + ABS_FLOOR, f"{name}: kernel {kernel_err:.3e} vs torch {torch_err:.3e}"


@pytest.mark.parametrize("B,H,T,D", SHAPES)
@pytest.mark.parametrize("device,dtype", FLASH_CASES)
def test_causal_matches_fp64_reference(device, dtype, B, H, T, D):
    _assert_flash_rule(attention, B, H, T, D, dtype, device, causal=True)


@pytest.mark.parametrize("B,H,T,D", [(1, 2, 7, 32), (1, 1, 65, 16)])
@pytest.mark.parametrize("device,dtype", FLASH_CASES)
def test_non_causal_matches_fp64_reference(device, dtype, B, H, T, D):
    _assert_flash_rule(attention, B, H, T, D, dtype, device, causal=False)


@ON_CUDA
@pytest.mark.parametrize("B,H,T,D", CUDA_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("causal", [True, False])
def test_model_shapes_match_fp64_reference_on_cuda(causal, dtype, B, H, T, D):
    _assert_flash_rule(attention, B, H, T, D, dtype, "cuda", causal=causal)


# fp16 exercises the 16-bit paths (p and dS cast to the input dtype before each dot). bf16 cannot be checked here:
# the interpreter's tl.dot multiplies bf16 storage as raw integers (triton 3.9 interpreter.create_dot); GPU only
# (FLASH_CASES).
@ON_CPU
@pytest.mark.parametrize("B,H,T,D", [(1, 2, 65, 32), (1, 1, 129, 64)])
def test_fp16_matches_fp64_reference(B, H, T, D):
    _assert_flash_rule(attention, B, H, T, D, dtype=torch.float16, causal=True)


# arch = "modern": q and k arrive RMS-normed per head (|q| = |k| = sqrt(D) exactly, so every score is within
# ±sqrt(D)) and rotated by position; the kernel is just q, k and must meet the same rule on them.
@pytest.mark.parametrize("B,H,T,D", [(1, 2, 7, 32), (1, 1, 65, 64)])
@pytest.mark.parametrize("device,dtype", FLASH_CASES)
def test_rotary_qk_normed_inputs_match_fp64_reference(device, dtype, B, H, T, D):
    _assert_flash_rule(attention, B, H, T, D, dtype, device, modern=True, causal=True)


@pytest.mark.parametrize("device", DEVICES)
def test_explicit_scale(device):
    _assert_flash_rule(attention, 1, 1, 33, 32, device=device, causal=True, scale=0.3)


# The GPU configs use unequal tiles (e.g. dK/dV over 128 keys streaming 32 queries); check the causal skipping
# bounds and masks with unequal tiles here, scaled down to the interpreter.
@pytest.mark.parametrize("config", [
    AttentionConfig(fwd=(32, 16), dkdv=(16, 32), dq=(32, 16), num_warps=1, num_stages=1),
    AttentionConfig(fwd=(16, 32), dkdv=(32, 16), dq=(16, 32), num_warps=1, num_stages=1),
])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("device", DEVICES)
def test_unequal_tiles(device, config, causal):
    _assert_flash_rule(lambda q, k, v, **kw: attention(q, k, v, config=config, **kw), 1, 1, 65, 32, device=device,
                       causal=causal)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_inputs_from_the_model(device):
    # The model splits a fused (B, T, 3C) projection and moves heads forward: q, k, v are strided views.
    B, T, H, D = 2, 64, 2, 32
    qkv = torch.randn(B, T, 3 * H * D, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    do = torch.randn(B, H, T, D, generator=torch.Generator().manual_seed(2)).to(device)
    grads = []
    for fn in (attention, attention_reference):
        q, k, v = (t.view(B, T, H, D).transpose(1, 2) for t in qkv.split(H * D, dim=2))  # (B, H, T, D)
        assert not q.is_contiguous()
        o = fn(q, k, v)
        assert o.shape == (B, H, T, D)
        (g,) = torch.autograd.grad(o, qkv, do)
        grads.append((o.detach(), g))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)  # fp32 vs fp32, O(1) values
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device,dtype", FLASH_CASES)
def test_two_runs_are_bit_identical(device, dtype):
    q, k, v, do = _inputs(2, 2, 65, 32, seed=3, device=device)
    first, second = (_run(attention, q, k, v, do, dtype) for _ in range(2))
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_launch_config_is_a_pinned_function_of_the_shape_class():
    assert attention_config(32, torch.float32, "cpu").fwd == (16, 16)
    for d in (16, 32, 64, 128):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            cfg = attention_config(d, dtype, "cuda")
            assert cfg == attention_config(d, dtype, "cuda")
            for bm, bn in (cfg.fwd, cfg.dkdv, cfg.dq):
                assert bm >= 16 and bn >= 16 and bm & (bm - 1) == 0 and bn & (bn - 1) == 0  # tl.dot minimum
    with pytest.raises(ValueError):
        attention_config(48, torch.bfloat16, "cuda")


def test_rejects_mismatched_inputs():
    q = torch.randn(1, 1, 8, 16)
    with pytest.raises(ValueError):
        attention(q, q, torch.randn(1, 1, 8, 32))
    with pytest.raises(ValueError):
        attention(q, q.double(), q)
