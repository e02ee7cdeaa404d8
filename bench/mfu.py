"""Model-FLOPs utilisation, one definition for every bench that reports it (bench/train.py, bench/gpu_train.py,
bench/peer.py). Reads and writes nothing.

FLOPs per token: PaLM's estimate (appendix B), as nanoGPT's `estimate_mfu` uses it: 6·N + 12·L·H·Q·T, where N is
the parameters that take part in matmuls (all but the token and position embedding tables, which are lookups; the
untied head is a matmul and counts), L layers, H heads of dimension Q (H·Q = n_embd), T the context (block_size).
6·N: forward and backward of every weight; 12·L·H·Q·T: the attention scores and their weighted sum, forward and
backward, at full context (causality is not discounted, as in PaLM and nanoGPT).

Peaks are dense (no 2:4 sparsity) tensor-core FLOP/s. andrea trains under bf16 autocast on CUDA, so its MFU is
against the bf16 peak; tf32 is kept beside it for fp32 matmuls. Source: NVIDIA's H100/H200 data sheets
(nvidia.com/en-us/data-center/h200, "H100 SXM / H200 SXM": BF16 Tensor Core 1,979 TFLOPS and TF32 989 TFLOPS,
both quoted with sparsity: halved here), the A100 data sheet (BF16 312, TF32 156 dense) and the RTX 4090's
Ada whitepaper (BF16 165.2 dense with FP32 accumulate at boost clock; TF32 82.6).
"""

from __future__ import annotations

PEAK_FLOPS = {  # device name substring -> dense tensor-core FLOP/s by matmul dtype
    "H200": {"bf16": 989e12, "tf32": 494e12},
    "H100": {"bf16": 989e12, "tf32": 494e12},
    "A100": {"bf16": 312e12, "tf32": 156e12},
    "RTX 4090": {"bf16": 165e12, "tf32": 82.6e12},
}


def flops_per_token(n_layer: int, n_head: int, n_embd: int, block_size: int, vocab_size: int, n_params: int) -> float:
    """6·N + 12·L·H·Q·T, with N = n_params less the two embedding tables (module docstring)."""
    head_dim = n_embd // n_head
    matmul_params = n_params - vocab_size * n_embd - block_size * n_embd
    return 6 * matmul_params + 12 * n_layer * n_head * head_dim * block_size


def model_flops_per_token(model_cfg, n_params: int) -> float:
    """flops_per_token of an andrea ModelConfig."""
    m = model_cfg
    return flops_per_token(m.n_layer, m.n_head, m.n_embd, m.block_size, m.vocab_size, n_params)


def peak_flops(device_name: str, dtype: str = "bf16") -> float | None:
    """The dense peak of the named device for `dtype` ("bf16" or "tf32"); None for a device not in the table."""
    for key, peaks in PEAK_FLOPS.items():
        if key in device_name:
            return peaks[dtype]
    return None


def mfu(tokens_per_s: float, flops_token: float, device_name: str, dtype: str = "bf16") -> float | None:
    """Achieved model FLOP/s over the device's peak; None where the peak is unknown (a CPU, an unlisted GPU)."""
    peak = peak_flops(device_name, dtype)
    return tokens_per_s * flops_token / peak if peak else None
