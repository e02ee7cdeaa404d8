"""Rotary embeddings (andrea/kernels/rotary.py): tables and reference against the half-split convention that a
stock `transformers` Llama/Qwen3 class applies (apply_rotary_pos_emb with rotate_half)."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from andrea.kernels import rotary_reference, rotary_tables


def test_tables_are_positions_times_inverse_frequencies():
    cos, sin = rotary_tables(7, 16, 10000.0)
    assert cos.shape == sin.shape == (7, 8) and cos.dtype == sin.dtype == torch.float32
    angle = torch.arange(7, dtype=torch.float64)[:, None] * 10000.0 ** (-torch.arange(0, 16, 2) / 16)[None, :]
    torch.testing.assert_close(cos.double(), angle.cos(), atol=1e-6, rtol=0)  # fp32 angles: ~1 ulp of t ≤ 6
    torch.testing.assert_close(sin.double(), angle.sin(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("shape", [(1, 1, 1, 16), (2, 3, 7, 64), (1, 2, 123, 32)], ids=lambda s: "x".join(map(str, s)))
def test_reference_is_hf_rotate_half(shape):
    B, H, T, D = shape
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(*shape, generator=gen) for _ in range(2))
    cos, sin = rotary_tables(T, D, 10000.0)
    # HF's tables repeat the D/2 angles over both halves, (B, T, D), and unsqueeze the head dim.
    hf_q, hf_k = apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None])
    torch.testing.assert_close(rotary_reference(q, cos, sin), hf_q, atol=0, rtol=0)
    torch.testing.assert_close(rotary_reference(k, cos, sin), hf_k, atol=0, rtol=0)
