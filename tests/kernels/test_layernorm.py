"""Fused LayerNorm (andrea/kernels/layernorm.py) against the plain-torch reference, under the Triton interpreter.

Same acceptance rule as attention: against an fp64 ground truth, the kernel's error is at most twice the error of
the plain-torch reference computed in fp32 (plus a floor), for y and each of dx, dweight, dbias.
Odd shapes: rows 1 / 7 / 130 (the interpreter's dW/dB groups are 16 rows: one partial group, and 9 groups with a
ragged last one), C 16 / 64 / 100 / 320 (100 and 320 are not powers of 2: masked tails).
The rule is tight enough to catch real bugs, and test_rule_catches_* proves it on deliberately wrong variants.
"""

import pytest
import torch
import torch.nn.functional as F

from andrea.kernels import layer_norm, layer_norm_reference
from andrea.kernels.layernorm import MAX_COLUMNS, layer_norm_config
from tests.kernels.conftest import ON_CPU

# CPU tensors under the interpreter only, for now; CUDA cases (bf16 input) are still to be written.
pytestmark = ON_CPU

# Errors here are a few fp32 ulps of O(1..40) values (~1e-7..1e-5) and the reference's can be 0 (one row, C = 16:
# both can round identically), where "2x of 0" would demand bit-equality. 1e-6 is ~8 ulps at magnitude 1: far below
# the bugs the rule must see (a wrong eps is off by >1e-4 on the small-variance rows, a dropped dbias by O(1)).
ABS_FLOOR = 1e-6
NAMES = ("y", "dx", "dweight", "dbias")


def _inputs(shape, seed=0, scale=2.0, bias=True):
    """x, weight, bias (or None), dy in fp64. x is shifted and scaled so mean and rstd both matter."""
    gen = torch.Generator().manual_seed(seed)
    C = shape[-1]
    x = scale * torch.randn(*shape, generator=gen, dtype=torch.float64) + 0.5
    weight = 1 + 0.3 * torch.randn(C, generator=gen, dtype=torch.float64)
    b = torch.randn(C, generator=gen, dtype=torch.float64) if bias else None
    dy = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return x, weight, b, dy


def _run(fn, x, weight, bias, dy, dtype, eps=1e-5):
    """(y, dx, dweight[, dbias]) of fn on copies cast to dtype (weight and bias stay fp32 below fp64), in fp64."""
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [x.detach().to(dtype).clone().requires_grad_()]
    leaves += [t.detach().to(param_dtype).clone().requires_grad_() for t in (weight, bias) if t is not None]
    y = fn(leaves[0], leaves[1], leaves[2] if bias is not None else None, eps=eps)
    y.backward(dy.to(dtype))
    return [y.detach().double()] + [leaf.grad.double() for leaf in leaves]


def _rule_violations(kernel_fn, x, weight, bias, dy, eps=1e-5):
    """Names of the outputs where kernel_fn breaks the 2x-of-fp32-torch rule against layer_norm_reference."""
    truth = _run(layer_norm_reference, x, weight, bias, dy, torch.float64, eps)
    plain_torch = _run(layer_norm_reference, x, weight, bias, dy, torch.float32, eps)
    kernel = _run(kernel_fn, x, weight, bias, dy, torch.float32, eps)
    bad = []
    for name, got, ref, exact in zip(NAMES, kernel, plain_torch, truth):
        kernel_err, torch_err = (got - exact).abs().max().item(), (ref - exact).abs().max().item()
        if not kernel_err <= 2 * torch_err + ABS_FLOOR:
            bad.append(f"{name}: kernel {kernel_err:.3e} vs torch {torch_err:.3e}")
    return bad


# 130 rows arrive as (B, T, C) = (2, 65, C): the launcher flattens the leading dims.
@pytest.mark.parametrize("C", [16, 64, 100, 320])
@pytest.mark.parametrize("lead", [(1,), (7,), (2, 65)])
def test_matches_fp64_reference(lead, C):
    assert _rule_violations(layer_norm, *_inputs((*lead, C))) == []


@pytest.mark.parametrize("shape", [(7, 100), (2, 65, 64)])
def test_without_bias(shape):
    assert _rule_violations(layer_norm, *_inputs(shape, bias=False)) == []


# Rows with variance ~1e-4, comparable to eps: here eps moves the output by ~5%, so it must be the right one.
@pytest.mark.parametrize("eps", [1e-5, 1e-3])
def test_small_variance_rows(eps):
    assert _rule_violations(layer_norm, *_inputs((7, 320), scale=1e-2), eps=eps) == []


def test_rule_catches_wrong_eps_and_missing_bias_grad():
    args = _inputs((2, 65, 100))
    small = _inputs((7, 320), scale=1e-2)
    # eps 2e-5 instead of 1e-5: rstd off by ~1e-6 relative at variance 4, by ~5% at variance 1e-4; both caught.
    wrong_eps = lambda x, w, b, eps: layer_norm(x, w, b, eps=2 * eps)
    assert "y" in " ".join(_rule_violations(wrong_eps, *args))
    assert "y" in " ".join(_rule_violations(wrong_eps, *small))
    # Same output, but the bias gradient is zero: caught on dbias only.
    no_bias_grad = lambda x, w, b, eps: layer_norm(x, w, b.detach(), eps=eps) + 0 * b
    assert [v.split(":")[0] for v in _rule_violations(no_bias_grad, *args)] == ["dbias"]
    # One row's dy dropped from dweight (a group boundary off by one): caught on dweight.
    def drop_last_row_from_dweight(x, w, b, eps):
        y = layer_norm(x, w, b, eps=eps)
        return torch.cat([y[:, :-1], layer_norm(x[:, -1:], w.detach(), b, eps=eps)], dim=1)
    assert "dweight" in " ".join(_rule_violations(drop_last_row_from_dweight, *args))


def test_reference_is_torch_layer_norm():
    x, weight, bias, _ = _inputs((7, 100))
    for b in (bias, None):
        torch.testing.assert_close(layer_norm_reference(x, weight, b, 1e-5), F.layer_norm(x, (100,), weight, b, 1e-5),
                                   rtol=1e-13, atol=1e-13)  # fp64: both exact to ~1e-15


def test_non_contiguous_input_with_leading_dims():
    # A (B, C, T) activation viewed as (B, T, C): a strided input the launcher must copy.
    B, T, C = 2, 33, 64
    base = torch.randn(B, C, T, generator=torch.Generator().manual_seed(1), requires_grad=True)
    weight, bias = torch.randn(C, requires_grad=True), torch.randn(C, requires_grad=True)
    dy = torch.randn(B, T, C, generator=torch.Generator().manual_seed(2))
    results = []
    for fn in (layer_norm, layer_norm_reference):
        x = base.transpose(1, 2)  # (B, T, C)
        assert not x.is_contiguous()
        y = fn(x, weight, bias)
        assert y.shape == (B, T, C)
        results.append((y.detach(), *torch.autograd.grad(y, (base, weight, bias), dy)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 vs fp32, O(1..10) values


def test_two_runs_are_bit_identical():
    for bias in (True, False):
        args = [t.float() if t is not None else None for t in _inputs((2, 65, 320), seed=3, bias=bias)]
        first, second = (_run(layer_norm, *args, torch.float32) for _ in range(2))
        assert len(first) == (4 if bias else 3)
        assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_fp16_input_gives_fp16_output_and_fp32_param_grads():
    x, weight, bias, dy = _inputs((7, 100), seed=4)
    got = _run(layer_norm, x, weight, bias, dy, torch.float16)
    x16, dy16 = x.half(), dy.half()  # both sides read the same fp16 values and compute in fp32
    want = _run(lambda x, w, b, eps: layer_norm_reference(x.float(), w, b, eps).half(), x16, weight, bias, dy16,
                torch.float16)
    # y and dx differ only by the final fp16 rounding (values <= 8: an fp16 ulp is <= 2**-7 ~ 8e-3, compared
    # relatively: rtol 2e-3 is two fp16 ulps); dweight/dbias are fp32 sums of fp32 terms: fp32 noise only.
    for name, g, w, tol in zip(NAMES, got, want, (2e-3, 2e-3, 1e-5, 1e-5)):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol, msg=name)
    leaf = x.half().requires_grad_()
    w32 = weight.float().requires_grad_()
    y = layer_norm(leaf, w32, None)
    y.backward(dy.half())
    assert y.dtype == leaf.grad.dtype == torch.float16 and w32.grad.dtype == torch.float32


def test_widest_row():
    assert _rule_violations(layer_norm, *_inputs((3, MAX_COLUMNS), seed=5)) == []


def test_launch_config_is_a_pinned_function_of_the_shape():
    assert layer_norm_config(130, 100, "cpu") == (128, 2, 16)
    for n_rows in (1, 7, 130, 65536, 10**6):
        for C in (1, 100, 768, MAX_COLUMNS):
            block, num_warps, rows_per_program = layer_norm_config(n_rows, C, "cuda")
            assert (block, num_warps, rows_per_program) == layer_norm_config(n_rows, C, "cuda")
            assert block >= C and block & (block - 1) == 0 and -(-n_rows // rows_per_program) <= 1024
    with pytest.raises(ValueError):
        layer_norm_config(8, MAX_COLUMNS + 1, "cuda")


def test_rejects_mismatched_inputs():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError):
        layer_norm(x, torch.ones(8))
    with pytest.raises(ValueError):
        layer_norm(x, torch.ones(16), torch.zeros(15))
    with pytest.raises(ValueError):
        layer_norm(torch.randn(4, MAX_COLUMNS + 1), torch.ones(MAX_COLUMNS + 1))
