"""andrea/control/observe/mfu.py: the PaLM FLOP count against torch's own count of the model's matmuls, the peak table, the rate."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from andrea.control.observe import mfu
from andrea.config.schema import ModelConfig
from andrea.kernels.attention import attention_reference
from andrea.model import arch
from andrea.model.gpt import GPT, ModelMath, layout_for, n_params
from andrea.model.modern import Modern


@pytest.mark.parametrize("shape", [dict(n_layer=2, n_head=3, n_embd=48, block_size=24, vocab_size=301),
                                   dict(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=260)])
def test_flops_per_token_equals_torchs_count_of_a_training_step(shape):
    """FlopCounterMode counts every matmul torch runs (mm, addmm, bmm: 2·m·n·k each) in one forward and backward
    at full context. The reference attention's q·kᵀ and (att)·v are plain matmuls over all T×T scores (the mask
    is applied elementwise afterwards), as the formula assumes; the embeddings are lookups and count nothing."""
    cfg = ModelConfig(**shape, dropout=0.0)
    model = GPT(cfg, ModelMath(attention=attention_reference))
    B, T = 3, cfg.block_size
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    with FlopCounterMode(display=False) as counter:
        logits, _ = model(idx)
        logits.float().square().mean().backward()  # a loss whose backward adds no matmul of its own
    counted = counter.get_total_flops() / (B * T)
    formula = mfu.model_flops_per_token(cfg, n_params(layout_for(cfg)))
    # PaLM's N is a parameter count: it includes the bias and LayerNorm vectors at 6 FLOPs each, which no matmul
    # multiplies (their adds are not matmul FLOPs, ~0.3 % of N here, less at scale). Counted apart, from the
    # model's own parameters, the rest is exact: both sides are integer counts of the same products.
    vectors = sum(p.numel() for p in model.parameters() if p.dim() == 1)
    assert formula - 6 * vectors == counted


@pytest.mark.parametrize("shape", [dict(n_layer=2, n_head=3, n_embd=48, block_size=24, vocab_size=301),
                                   dict(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=260)])
def test_the_modern_models_flops_equal_torchs_count_exactly(shape):
    """The modern model (rotary, RMSNorm, QK-norm, SwiGLU): every parameter but the token embedding is a matmul
    weight (no position table, no bias or norm vector), so the formula is torch's count to the FLOP; rotary, the
    norms and SwiGLU's gate are elementwise and FlopCounterMode counts none of them, as PaLM's formula does not."""
    cfg = ModelConfig(**shape, arch="modern")
    model = Modern(cfg, ModelMath(attention=attention_reference))
    B, T = 3, cfg.block_size
    with FlopCounterMode(display=False) as counter:
        logits, _ = model(torch.randint(0, cfg.vocab_size, (B, T)))
        logits.float().square().mean().backward()
    assert mfu.model_flops_per_token(cfg, n_params(arch.layout_for(cfg))) == counter.get_total_flops() / (B * T)
    gpt_formula = mfu.flops_per_token(cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.vocab_size,
                                      n_params(arch.layout_for(cfg)))
    assert gpt_formula < counter.get_total_flops() / (B * T)  # a position table it does not have, not subtracted


def test_the_peak_table_matches_the_names_torch_reports():
    assert mfu.table_peak("NVIDIA H200") == 989.4e12
    assert mfu.table_peak("NVIDIA H100 80GB HBM3") == 989.4e12
    assert mfu.table_peak("NVIDIA H100 PCIe") == 756.5e12
    assert mfu.table_peak("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12
    assert mfu.table_peak("NVIDIA L4") == 121e12
    assert mfu.table_peak("NVIDIA L40S") == 362.1e12  # not L4's
    assert mfu.table_peak("NVIDIA GeForce RTX 3090") == 71e12
    assert mfu.table_peak("NVIDIA GeForce RTX 4090", "tf32") == 82.6e12
    assert mfu.table_peak("Tesla T4") is None


def test_a_cpu_has_no_peak_unless_one_is_configured():
    cpu = mfu.device_peak("cpu", "", "bf16", 0.0)
    assert cpu.flops is None and "set train.peak_tflops" in cpu.source
    assert mfu.mfu(1e6, 1e6, cpu.flops) is None
    unknown = mfu.device_peak("cuda", "Tesla T4", "bf16", 0.0)
    assert unknown.flops is None and "Tesla T4" in unknown.source
    assert mfu.device_peak("cuda", "NVIDIA H200", "bf16", 0.0, devices=2).flops == 2 * 989.4e12
    configured = mfu.device_peak("cpu", "", "bf16", 2.5, devices=2)
    assert configured.flops == 5e12 and mfu.mfu(1000.0, 1e9, configured.flops) == pytest.approx(0.2)


def test_throughput_over_a_window_of_steps():
    rate = mfu.Throughput(tokens_per_step=100, span=2)
    assert rate.observe(1, 10.0) is None  # one point: no rate yet
    assert rate.observe(2, 10.5) == pytest.approx(200.0)
    assert rate.observe(3, 11.0) == pytest.approx(200.0)  # (3 - 1) steps in 1 s
    assert rate.observe(4, 13.0) == pytest.approx(200 / 2.5)  # the window dropped step 1: (4 - 2) in 2.5 s
    rate.reset()
    assert rate.observe(2, 20.0) is None  # after a rollback to 2 nothing before it counts
