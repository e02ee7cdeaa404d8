"""Fused LayerNorm (andrea/kernels/layernorm.py) against the plain-torch reference: on the CPU under the Triton
interpreter, and on CUDA with compiled kernels when a GPU is present (tests/unit/kernels/conftest.py decides which).

Acceptance rule (FlashAttention's, as for attention): against an fp64 ground truth computed from the very values the
kernel reads, the kernel's error is at most twice the error of layer_norm_reference run in the same dtype on the same
device (plus a floor), for y and each of dx, dweight, dbias. Weight and bias are fp32 throughout, as the model's
parameters. fp32 input runs on both devices; fp16 input on both (the interpreter computes in fp16 but not in bf16);
bf16 input on CUDA only. In fp16/bf16 the reference rounds mean, variance and rstd to the input dtype, so the rule
alone would let a kernel do the same; test_low_precision_rounds_once also holds the kernel to within one ulp of
fp32 math rounded once, and output and gradient dtypes are checked against F.layer_norm's.
Odd shapes: rows 1 / 7 / 130 (the interpreter's dW/dB groups are 16 rows: one partial group, and 9 groups with a
ragged last one; on CUDA one row per group), C 16 / 64 / 100 / 320 / 768 (100, 320 and 768 are not powers of 2:
masked tails). CUDA also runs the presets' (B, T, C): andrea-12m's (32, 256, 320) and andrea-120m's (16, 1024, 768)
(8 and 16 rows per group, 1024 groups), and 3001 rows (1001 groups of 3, the last one a single row).
The rules are tight enough to catch real bugs, and test_*_catches_* prove it on deliberately wrong variants.
"""

import pytest
import torch
import torch.nn.functional as F

from andrea.kernels import layer_norm, layer_norm_reference
from andrea.kernels.layernorm import MAX_COLUMNS, layer_norm_backward, layer_norm_config, layer_norm_forward
from tests.unit.kernels.conftest import DEVICES, ON_CPU, ON_CUDA

# y and dx: errors are a few fp32 ulps of O(1..10) values (~1e-7..1e-6) and the reference's can be 0 (one row, C = 16:
# both can round identically), where "2x of 0" would demand bit-equality. 1e-6 is ~8 ulps at magnitude 1: far below
# the bugs the rule must see (a wrong eps is off by ~1e-5 at variance 4 and by >1e-2 on the small-variance rows, a
# dropped dbias by O(1)). In fp16/bf16 the reference's own error on y and dx is tens of ulps of the input dtype
# (~1e-3..1e-1), so the floor never decides there.
ABS_FLOOR = 1e-6
# dweight and dbias are sums over the N rows, |sum| up to ~3.5 sqrt(N) (~45 at 130 rows, ~300 at 16384): kernel (fixed
# groups of rows, then torch's sum over the groups) and torch add in different orders, each a few fp32 ulps of the
# sum off, and either can land exactly (fp16/bf16 dy has 11/8 significant bits: 130 of them often sum exactly in
# fp32). Their floor is ABS_FLOOR per unit of the largest |sum|: ~8 fp32 ulps (2**-23 ~ 1.2e-7) of it; a dropped
# row or a dropped dbias is off by O(1).
SUM_OUTPUTS = ("dweight", "dbias")
NAMES = ("y", "dx", "dweight", "dbias")

FP16, BF16 = torch.float16, torch.bfloat16
# (device, dtype) of the input, for the low-precision cases: the interpreter has no bf16 arithmetic.
LOW_PRECISION = [pytest.param("cpu", FP16, marks=ON_CPU, id="cpu-fp16"),
                 pytest.param("cuda", FP16, marks=ON_CUDA, id="cuda-fp16"),
                 pytest.param("cuda", BF16, marks=ON_CUDA, id="cuda-bf16")]
EVERY_DTYPE = [pytest.param("cpu", torch.float32, marks=ON_CPU, id="cpu-fp32"),
               pytest.param("cuda", torch.float32, marks=ON_CUDA, id="cuda-fp32"), *LOW_PRECISION]
# (B, T, C) as the trainer feeds ln_1 / ln_2 / ln_f: C = 320 (andrea-12m), 768 (andrea-120m), and an odd 100.
TRAINER_C = [(2, 65, 100), (2, 65, 320), (2, 65, 768)]
# GPU only: the presets' full batches and a ragged last group. Milliseconds on a GPU, hours under the interpreter.
CUDA_SHAPES = [(32, 256, 320), (16, 1024, 768), (3001, 100)]


def _shape_id(shape):
    return "x".join(map(str, shape))


def _inputs(shape, seed=0, scale=2.0, bias=True, device="cpu"):
    """x, weight, bias (or None), dy in fp64 on device. x is shifted and scaled so mean and rstd both matter."""
    gen = torch.Generator().manual_seed(seed)  # drawn on the CPU: the same values on every device
    C = shape[-1]
    x = scale * torch.randn(*shape, generator=gen, dtype=torch.float64) + 0.5
    weight = 1 + 0.3 * torch.randn(C, generator=gen, dtype=torch.float64)
    b = torch.randn(C, generator=gen, dtype=torch.float64) if bias else None
    dy = torch.randn(*shape, generator=gen, dtype=torch.float64)
    return [t if t is None else t.to(device) for t in (x, weight, b, dy)]


def _run(fn, x, weight, bias, dy, dtype, eps=1e-5):
    """(y, dx, dweight[, dbias]) of fn on copies cast to dtype (weight and bias stay fp32 below fp64), in fp64."""
    param_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [x.detach().to(dtype).clone().requires_grad_()]
    leaves += [t.detach().to(param_dtype).clone().requires_grad_() for t in (weight, bias) if t is not None]
    y = fn(leaves[0], leaves[1], leaves[2] if bias is not None else None, eps=eps)
    y.backward(dy.to(dtype))
    return [y.detach().double()] + [leaf.grad.double() for leaf in leaves]


def _rounded(x, weight, bias, dy, dtype):
    """The fp64 values a dtype run reads: x and dy rounded to dtype, weight and bias to fp32."""
    as_read = lambda t, d: None if t is None else t.to(d).double()
    return as_read(x, dtype), as_read(weight, torch.float32), as_read(bias, torch.float32), as_read(dy, dtype)


def _rule_violations(kernel_fn, x, weight, bias, dy, eps=1e-5, dtype=torch.float32):
    """Names of the outputs where kernel_fn breaks the 2x-of-torch-in-dtype rule against layer_norm_reference."""
    # Truth from the rounded inputs: input rounding is common to both sides and would only pad both errors.
    truth = _run(layer_norm_reference, *_rounded(x, weight, bias, dy, dtype), torch.float64, eps)
    plain_torch = _run(layer_norm_reference, x, weight, bias, dy, dtype, eps)
    kernel = _run(kernel_fn, x, weight, bias, dy, dtype, eps)
    bad = []
    for name, got, ref, exact in zip(NAMES, kernel, plain_torch, truth):
        kernel_err, torch_err = (got - exact).abs().max().item(), (ref - exact).abs().max().item()
        floor = ABS_FLOOR * max(1.0, exact.abs().max().item()) if name in SUM_OUTPUTS else ABS_FLOOR
        if not kernel_err <= 2 * torch_err + floor:
            bad.append(f"{name}: kernel {kernel_err:.3e} vs torch {torch_err:.3e}")
    return bad


def _ulp(t, dtype):
    """Spacing of dtype's values at |t| (fp64 t): eps * 2**floor(log2|t|), the subnormal spacing below tiny."""
    info = torch.finfo(dtype)
    return info.eps * torch.exp2(torch.floor(torch.log2(t.abs().clamp_min(info.tiny))))


def _rounding_violations(fn, x, weight, bias, dy, dtype, eps=1e-5):
    """Names of the outputs where fn is more than one ulp (of that output's dtype) plus fp32 noise away from the
    reference computed in fp32 on the same rounded inputs and rounded once to the output dtype.

    fn and the fp32 math land within fp32 noise of each other before the final rounding, so they round to the same
    or to adjacent values: at most one ulp of the output dtype apart (at most 2**-10 of the value in fp16, 2**-7 in
    bf16). The noise term is 16 fp32 ulps of the output's largest magnitude. It covers: values left far below that
    magnitude by cancellation (y = x_hat * w + b ~ 0, dx's three terms), whose fp16/bf16 ulps are finer than the
    fp32 noise of the terms that cancelled; dweight/dbias, fp32 sums added in different orders (measured under the
    interpreter: within 1 fp32 ulp of the largest |sum|); and CUDA's approximate sqrt and division in rstd (a
    kernel whose rstd is 3 fp32 ulps high on every row, emulated at (16, 1024, 768), passes). Plain torch in
    fp16/bf16 is off by tens to thousands of ulps; a dweight rounded to fp16 is off by up to 2**-11 of itself,
    ~250x the noise term at the largest sums.
    """
    fp32_math = lambda x, w, b, eps: layer_norm_reference(x.float(), w, b, eps).to(x.dtype)
    want = _run(fp32_math, x, weight, bias, dy, dtype, eps)
    got = _run(fn, x, weight, bias, dy, dtype, eps)
    bad = []
    for name, g, w, out_dtype in zip(NAMES, got, want, (dtype, dtype, torch.float32, torch.float32)):
        allowed = _ulp(w, out_dtype) + 16 * torch.finfo(torch.float32).eps * w.abs().max()
        if not bool(((g - w).abs() <= allowed).all()):
            bad.append(f"{name}: {((g - w).abs() > allowed).sum().item()} of {w.numel()} beyond one ulp")
    return bad


# 130 rows arrive as (B, T, C) = (2, 65, C): the launcher flattens the leading dims.
@pytest.mark.parametrize("C", [16, 64, 100, 320])
@pytest.mark.parametrize("lead", [(1,), (7,), (2, 65)])
@pytest.mark.parametrize("device", DEVICES)
def test_matches_fp64_reference(device, lead, C):
    assert _rule_violations(layer_norm, *_inputs((*lead, C), device=device)) == []


@pytest.mark.parametrize("shape", TRAINER_C, ids=_shape_id)
@pytest.mark.parametrize("device,dtype", LOW_PRECISION)
def test_low_precision_matches_fp64_reference(device, dtype, shape):
    assert _rule_violations(layer_norm, *_inputs(shape, device=device), dtype=dtype) == []


@ON_CUDA
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", [torch.float32, FP16, BF16], ids=["fp32", "fp16", "bf16"])
def test_trainer_batches_match_fp64_reference_on_cuda(dtype, shape):
    assert _rule_violations(layer_norm, *_inputs(shape, device="cuda"), dtype=dtype) == []


@pytest.mark.parametrize("shape", [(7, 100), (2, 65, 768)], ids=_shape_id)
@pytest.mark.parametrize("device,dtype", LOW_PRECISION)
def test_low_precision_rounds_once(device, dtype, shape):
    assert _rounding_violations(layer_norm, *_inputs(shape, seed=4, device=device), dtype) == []


@ON_CUDA
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=_shape_id)
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_low_precision_rounds_once_at_trainer_batches_on_cuda(dtype, shape):
    assert _rounding_violations(layer_norm, *_inputs(shape, seed=4, device="cuda"), dtype) == []


@pytest.mark.parametrize("shape", [(7, 100), (2, 65, 64)], ids=_shape_id)
@pytest.mark.parametrize("device", DEVICES)
def test_without_bias(device, shape):
    assert _rule_violations(layer_norm, *_inputs(shape, bias=False, device=device)) == []


@pytest.mark.parametrize("device,dtype", LOW_PRECISION)
def test_low_precision_without_bias(device, dtype):
    args = _inputs((7, 320), bias=False, device=device)
    assert _rule_violations(layer_norm, *args, dtype=dtype) == []
    assert _rounding_violations(layer_norm, *args, dtype) == []


# Rows with variance ~1e-4, comparable to eps: here eps moves the output by ~5%, so it must be the right one.
@pytest.mark.parametrize("eps", [1e-5, 1e-3])
@pytest.mark.parametrize("device", DEVICES)
def test_small_variance_rows(device, eps):
    assert _rule_violations(layer_norm, *_inputs((7, 320), scale=1e-2, device=device), eps=eps) == []


@pytest.mark.parametrize("device", DEVICES)
def test_rule_catches_wrong_eps_and_missing_bias_grad(device):
    args = _inputs((2, 65, 100), device=device)
    small = _inputs((7, 320), scale=1e-2, device=device)
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


class _RoundGrad(torch.autograd.Function):
    """Identity whose backward rounds the gradient through a dtype: dW/dB partials kept in the input dtype."""

    @staticmethod
    def forward(ctx, t, dtype):
        ctx.dtype = dtype
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype).to(grad.dtype), None


@pytest.mark.parametrize("device,dtype", LOW_PRECISION)
def test_rounding_check_catches_low_precision_math(device, dtype):
    args = _inputs((2, 65, 100), device=device)
    # Plain torch in the input dtype (what the 2x rule accepts as its baseline): off on y, dx and dweight.
    assert [v.split(":")[0] for v in _rounding_violations(layer_norm_reference, *args, dtype)] == [
        "y", "dx", "dweight"]
    # The kernel with dweight rounded to the input dtype: caught on dweight only.
    low_dweight = lambda x, w, b, eps: layer_norm(x, _RoundGrad.apply(w, x.dtype), b, eps=eps)
    assert [v.split(":")[0] for v in _rounding_violations(low_dweight, *args, dtype)] == ["dweight"]


def test_reference_is_torch_layer_norm():
    x, weight, bias, _ = _inputs((7, 100))
    for b in (bias, None):
        torch.testing.assert_close(layer_norm_reference(x, weight, b, 1e-5), F.layer_norm(x, (100,), weight, b, 1e-5),
                                   rtol=1e-13, atol=1e-13)  # fp64: both exact to ~1e-15


# Low-precision x with fp32 weight and bias (the trainer's parameters): pure torch on the CPU, whose F.layer_norm
# takes mixed dtypes and returns x's.
@pytest.mark.parametrize("dtype", [FP16, BF16], ids=["fp16", "bf16"])
def test_reference_dtypes_are_torch_layer_norms(dtype):
    x, weight, bias, dy = _inputs((7, 100))
    dtypes = []
    for fn in (layer_norm_reference, lambda x, w, b: F.layer_norm(x, (100,), w, b)):
        leaves = [t.to(d).requires_grad_() for t, d in ((x, dtype), (weight, torch.float32), (bias, torch.float32))]
        y = fn(*leaves)
        dtypes.append([y.dtype] + [g.dtype for g in torch.autograd.grad(y, leaves, dy.to(y.dtype))])
    assert dtypes[0] == dtypes[1] == [dtype, dtype, torch.float32, torch.float32]


@pytest.mark.parametrize("device,dtype", EVERY_DTYPE)
def test_output_and_gradient_dtypes_follow_torch(device, dtype):
    x, weight, bias, dy = _inputs((7, 100), device=device)
    x, weight, bias, dy = x.to(dtype), weight.float(), bias.float(), dy.to(dtype)
    # What torch gives for these dtypes (on the CPU, whose F.layer_norm takes mixed dtypes); autograd would cast a
    # wrongly typed gradient to its leaf's dtype, so the kernel's raw outputs are checked, not leaf.grad.
    leaves = [t.detach().cpu().requires_grad_() for t in (x, weight, bias)]
    want_y = F.layer_norm(leaves[0], (100,), leaves[1], leaves[2])
    want = [want_y.dtype] + [g.dtype for g in torch.autograd.grad(want_y, leaves, dy.cpu())]
    y, x2d, mean, rstd = layer_norm_forward(x, weight, bias)
    dx, dweight, dbias = layer_norm_backward(dy, x2d, weight, mean, rstd, has_bias=True)
    assert [y.dtype, dx.dtype, dweight.dtype, dbias.dtype] == want
    assert mean.dtype == rstd.dtype == torch.float32
    assert layer_norm(x, weight, bias).dtype == want[0]


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_input_with_leading_dims(device):
    # A (B, C, T) activation viewed as (B, T, C): a strided input the launcher must copy.
    B, T, C = 2, 33, 64
    gen = torch.Generator().manual_seed(1)
    base, dy = torch.randn(B, C, T, generator=gen).to(device), torch.randn(B, T, C, generator=gen).to(device)
    weight, bias = (torch.randn(C, generator=gen).to(device) for _ in range(2))
    base, weight, bias = (t.requires_grad_() for t in (base, weight, bias))
    results = []
    for fn in (layer_norm, layer_norm_reference):
        x = base.transpose(1, 2)  # (B, T, C)
        assert not x.is_contiguous()
        y = fn(x, weight, bias)
        assert y.shape == (B, T, C)
        results.append((y.detach(), *torch.autograd.grad(y, (base, weight, bias), dy)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32 vs fp32, O(1..10) values


# The CPU runs the interpreter's 9 groups of 16 rows (sequential programs: fp32 only); CUDA andrea-12m's batch,
# 1024 groups of 8 rows, in every dtype.
@pytest.mark.parametrize("device,dtype", [p for p in EVERY_DTYPE if p.id != "cpu-fp16"])
def test_two_runs_are_bit_identical(device, dtype):
    shape = (2, 65, 320) if device == "cpu" else (32, 256, 320)
    for bias in (True, False):
        args = _inputs(shape, seed=3, bias=bias, device=device)
        first, second = (_run(layer_norm, *args, dtype) for _ in range(2))
        assert len(first) == (4 if bias else 3)
        assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("device", DEVICES)
def test_widest_row(device):
    assert _rule_violations(layer_norm, *_inputs((3, MAX_COLUMNS), seed=5, device=device)) == []


def test_launch_config_is_a_pinned_function_of_the_shape():
    assert layer_norm_config(130, 100, "cpu") == (128, 2, 16)
    for n_rows in (1, 7, 130, 65536, 10**6):
        for C in (1, 100, 768, MAX_COLUMNS):
            block, num_warps, rows_per_program = layer_norm_config(n_rows, C, "cuda")
            assert (block, num_warps, rows_per_program) == layer_norm_config(n_rows, C, "cuda")
            assert block >= C and block & (block - 1) == 0 and -(-n_rows // rows_per_program) <= 1024
    with pytest.raises(ValueError):
        layer_norm_config(8, MAX_COLUMNS + 1, "cuda")


@pytest.mark.parametrize("device", DEVICES)
def test_rejects_mismatched_inputs(device):
    x = torch.randn(4, 16, device=device)
    with pytest.raises(ValueError):
        layer_norm(x, torch.ones(8, device=device))
    with pytest.raises(ValueError):
        layer_norm(x, torch.ones(16, device=device), torch.zeros(15, device=device))
    with pytest.raises(ValueError):
        layer_norm(torch.randn(4, MAX_COLUMNS + 1, device=device), torch.ones(MAX_COLUMNS + 1, device=device))
    # the kernels read the parameters as contiguous fp32 rows: anything else is refused, never misread
    with pytest.raises(ValueError, match="weight must be a contiguous fp32"):
        layer_norm(x, torch.ones(32, device=device)[::2])
    with pytest.raises(ValueError, match="bias must be a contiguous fp32"):
        layer_norm(x, torch.ones(16, device=device), torch.zeros(16, device=device, dtype=torch.float16))
