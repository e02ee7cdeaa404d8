"""Model-FLOPs utilisation (MFU): the FLOPs a step needs by the model's shape, over the device's peak. Reads and
writes nothing; the training loop (control/run/boundary.py), `status` and the benches (bench/train.py, gpu_train.py,
peer.py) all use these definitions.

FLOPs per token: PaLM's estimate (Chowdhery et al. 2022, appendix B), as nanoGPT's `estimate_mfu` and llm.c use it:

    6·N + 12·L·H·Q·T

N is the parameter count less the token and position embedding tables, which are lookups (andrea's output head
is untied, a matmul of its own, and counts). As in PaLM and nanoGPT, N keeps the bias and LayerNorm vectors,
which no matmul multiplies: 6 FLOPs each that are not spent, 0.1-0.3 % of N (tests/unit/control/observe/test_mfu.py counts them apart). 6·N is the forward (2 FLOPs per weight
per token) and the backward (4: the gradients of the input and of the weight). 12·L·H·Q·T is attention: L layers,
H heads of dimension Q (H·Q = n_embd), a context of T = block_size; per layer and token the scores q·kᵀ and the
weighted sum of v are 2·2·H·Q·T forward and twice that backward. Causality is not discounted (as in PaLM and
nanoGPT): MFU compares trainers by the model's work, not by how cleverly a kernel skips the masked half.

The modern model (`model.arch = "modern"`, andrea/model/modern.py) has no position table, so N is the parameter
count less the token embedding alone; its SwiGLU MLP's three matrices, its separate q, k, v and o projections and
its untied head are all in N. What it adds besides matmuls is elementwise and O(C) per token, not counted (as
PaLM leaves out softmax, norms and activations): rotary (6 FLOPs per rotated pair of q and k), the RMSNorms (QK-norm
per head, two per block and the final one: ~4 per element), SwiGLU's SiLU and product. At andrea-12m-modern's
shape those are ~0.3 % of 6·N, forward and backward. A modern model has no bias or norm vector, so its N is
matmul weights only and the formula equals torch's count exactly (tests/unit/control/observe/test_mfu.py). Its
parts (model.value_embeds, resid_lambdas, smear, backout) add lookups and scalars, left out of N as the embedding
is (`lookup_params`), and two small gates, matmuls in N: torch's count still
(tests/unit/model/test_parts.py).

Peaks are dense tensor-core FLOP/s (no 2:4 sparsity), from NVIDIA's data sheets and architecture whitepapers (the
H100/H200 SXM sheet quotes BF16 1,979 and TF32 989 TFLOPS with sparsity: halved here). On CUDA andrea trains under
bf16 autocast, so its MFU is against the bf16 column; `tf32` and `fp32` (plain CUDA cores: torch's default for an
fp32 matmul) are there for other precisions. A device not in the table gets its peak from `train.peak_tflops`;
a CPU has no peak worth quoting, and MFU is then unknown (None) and said so, never invented.
"""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass

# (pattern on torch.cuda.get_device_name, dense peak TFLOP/s by matmul precision). First match wins: the more
# specific names (H100 PCIe / NVL, L40S) come before the names they contain.
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    (r"H200", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"H100 PCIe", {"bf16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    (r"H100 NVL", {"bf16": 835.5, "tf32": 417.5, "fp32": 60.0}),
    (r"H100", {"bf16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM ("NVIDIA H100 80GB HBM3")
    (r"A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"RTX 4090", {"bf16": 165.2, "tf32": 82.6, "fp32": 82.6}),  # bf16 with fp32 accumulate (Ada whitepaper)
    (r"RTX 3090", {"bf16": 71.0, "tf32": 35.6, "fp32": 35.6}),  # GA102 whitepaper, fp32 accumulate
]


def flops_per_token(n_layer: int, n_head: int, n_embd: int, block_size: int, vocab_size: int, n_params: int,
                    position_table: bool = True) -> float:
    """6·N + 12·L·H·Q·T, N = n_params less the embedding tables: the token one, and the position one when the model
    has it (the GPT; the modern model's rotary positions are not a table) (module docstring)."""
    head_dim = n_embd // n_head
    matmul_params = n_params - vocab_size * n_embd - (block_size * n_embd if position_table else 0)
    return 6 * matmul_params + 12 * n_layer * n_head * head_dim * block_size


def lookup_params(m) -> int:
    """A modern ModelConfig's parts' parameters that no matmul multiplies: the value-embedding tables, (V, C) in
    every other layer ending with the last (andrea/config/model.py `value_embed_layers`), and the scalars (resid
    and x0 lambdas, smear's λ, backout's β); the gates are matmul weights."""
    L = m.n_layer
    tables = sum(i % 2 == (L - 1) % 2 for i in range(L)) * m.vocab_size * m.n_embd if m.value_embeds else 0
    return tables + 2 * L * m.resid_lambdas + m.smear + m.backout


def model_flops_per_token(model_cfg, n_params: int) -> float:
    """flops_per_token of an andrea ModelConfig (either arch); a modern model's value-embedding tables and scalars
    (`lookup_params`) are no matmul weights either."""
    m = model_cfg
    lookups = lookup_params(m) if m.arch == "modern" else 0
    return flops_per_token(m.n_layer, m.n_head, m.n_embd, m.block_size, m.vocab_size, n_params - lookups,
                           position_table=m.arch == "gpt2")


def table_peak(device_name: str, dtype: str = "bf16") -> float | None:
    """The dense peak FLOP/s of the named GPU for `dtype` ("bf16", "tf32", "fp32"); None when it is not listed."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peaks[dtype] * 1e12
    return None


@dataclass(frozen=True)
class Peak:
    """What MFU is measured against: FLOP/s of all the devices of the run together (None: unknown) and where the
    figure came from, said in the start marker, the progress line and `status`."""

    flops: float | None
    source: str


def device_peak(device_type: str, device_name: str, dtype: str, peak_tflops: float, devices: int = 1) -> Peak:
    """The run's peak: `train.peak_tflops` (per device) when set, else the table's for a GPU it lists; on a CPU
    or an unlisted GPU, None with the reason."""
    if peak_tflops > 0:
        return Peak(peak_tflops * 1e12 * devices, f"train.peak_tflops={peak_tflops:g} x {devices}")
    if device_type != "cuda":
        return Peak(None, f"{device_type}: no peak to measure against (set train.peak_tflops)")
    peak = table_peak(device_name, dtype)
    if peak is None:
        return Peak(None, f"{device_name} is not in andrea/control/observe/mfu.py's table (set train.peak_tflops)")
    return Peak(peak * devices, f"{device_name} {dtype} {peak / 1e12:g} TFLOP/s x {devices}")


def mfu(tokens_per_s: float, flops_token: float, peak: float | None) -> float | None:
    """Achieved model FLOP/s over the peak; None where the peak is unknown."""
    return tokens_per_s * flops_token / peak if peak else None


class Throughput:
    """Tokens per second over the last `span` steps, from the times the control plane took each step's record.

    `observe(step, now)` returns the rate once two points are in the window, else None. `reset()` starts over
    (a rollback rewinds the step; a new process has no earlier point). The window's wall time includes what
    happens between steps (checkpoint snapshots, audits): MFU is the whole loop's, as a person paying for the
    GPU sees it."""

    def __init__(self, tokens_per_step: int, span: int):
        self.tokens_per_step = tokens_per_step
        self.points: deque[tuple[int, float]] = deque(maxlen=max(span, 1) + 1)

    def reset(self) -> None:
        self.points.clear()

    def observe(self, step: int, now: float) -> float | None:
        self.points.append((step, now))
        (s0, t0), (s1, t1) = self.points[0], self.points[-1]
        if s1 <= s0 or t1 <= t0:
            return None
        return (s1 - s0) * self.tokens_per_step / (t1 - t0)


class Meter:
    """The training loop's MFU: `observe(step, now)` -> (tokens/s, achieved model FLOP/s, MFU), each None until
    the window holds two points (MFU also None without a peak)."""

    def __init__(self, flops_token: float, peak: Peak, tokens_per_step: int, span: int):
        self.flops_token, self.peak = flops_token, peak
        self.rate = Throughput(tokens_per_step, span)

    def reset(self) -> None:
        self.rate.reset()

    def observe(self, step: int, now: float) -> tuple[float | None, float | None, float | None]:
        tokens_per_s = self.rate.observe(step, now)
        if tokens_per_s is None:
            return None, None, None
        return tokens_per_s, tokens_per_s * self.flops_token, mfu(tokens_per_s, self.flops_token, self.peak.flops)
