"""Parameter-free RMSNorm (andrea/kernels/rmsnorm.py): the reference against torch's own F.rms_norm."""

import pytest
import torch
import torch.nn.functional as F

from andrea.kernels import rms_norm_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1, 16), (7, 100), (2, 5, 320)], ids=lambda s: "x".join(map(str, s)))
def test_reference_is_torch_rms_norm_in_fp32(shape, dtype):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    want = F.rms_norm(x.float(), (shape[-1],), eps=1e-6).to(dtype)  # fp32 math, rounded once
    got = rms_norm_reference(x, 1e-6)
    assert got.dtype == dtype
    # fp32: the two may sum the squares in different orders (a few ulps; assert_close's fp32 default 1.3e-6 rtol).
    # fp16/bf16: those fp32 ulps vanish in the one final rounding.
    exact = dtype != torch.float32
    torch.testing.assert_close(got, want, atol=0 if exact else None, rtol=0 if exact else None)
