"""The modern model (model.arch = "modern", andrea/model/modern.py): its parameters are views into the flat buffer in
the documented order, its initialisation is seeded, QK-norm and the parameter-free norms hold, micro-batches and
activation checkpointing give the plain run's step, and KV-cached generation (rotary at each slot's position)
follows the full forward.

Tolerances are the GPT's (tests/e2e/test_microbatch.py, tests/e2e/test_generation.py), for the same reasons: a
micro-batch changes only the order of the weight gradients' sums over rows; the cached and uncached decodes are the
same math in different summation orders, both held against an fp64 forward.
"""

import math
from functools import partial

import numpy as np
import pytest
import torch

from andrea.config import load as configload
from andrea.model import arch, generate as generation, memory
from andrea.model.gpt import ModelMath, n_params
from andrea.config.schema import swiglu_hidden
from andrea.model.modern import Modern, split_heads
from andrea.rundir.checkpoint_write import commit_checkpoint
from andrea.control.run.trainer import Trainer
from tests.activations import saved_bytes

MODEL = {"arch": "modern", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 300}
LOSS_RTOL, NORM_RTOL, WEIGHT_ATOL = 1e-5, 1e-5, 1e-5  # tests/e2e/test_microbatch.py's


def modern_cfg(model=None, **train):
    return configload.from_dict({"model": {**MODEL, **(model or {})},
                                 "train": {"batch_size": 8, "warmup_steps": 2, "lr": 1e-3, **train}})


def documented_order(n_layer: int) -> list[str]:
    """The order andrea/model/modern.py's docstring promises (and docs/formats.md#the-checkpoint-format states)."""
    names = ["wte.weight"]
    for i in range(n_layer):
        names += [f"h.{i}.attn.{p}_proj.weight" for p in ("q", "k", "v", "o")]
        names += [f"h.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    return names + ["lm_head.weight"]


def batches(n: int, rows: int = 8, T: int = 16, V: int = 300):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randint(0, V, (rows, T), generator=gen), torch.randint(0, V, (rows, T), generator=gen))
            for _ in range(n)]


def run_steps(trainer: Trainer, data) -> list[tuple[float, float]]:
    out = [trainer.train_step(s, x, y) for s, (x, y) in enumerate(data)]
    trainer._wait_snapshot()
    return [(float(o.loss), float(o.grad_norm)) for o in out]


def test_parameters_are_flat_views_in_the_documented_order(tmp_path):
    t = Trainer(modern_cfg(), torch.device("cpu"))
    params = dict(t.model.named_parameters())
    assert list(params) == documented_order(2)
    H = swiglu_hidden(32)
    assert params["h.0.mlp.gate_proj.weight"].shape == (H, 32) and params["h.1.mlp.down_proj.weight"].shape == (32, H)
    with torch.no_grad():
        for i, p in enumerate(params.values()):
            p.fill_(float(i))  # through the views into the flat buffer
    weights = np.fromfile(commit_checkpoint(tmp_path, 1, t.state.buffer.numpy()), dtype="<f4", offset=8,
                          count=t.n)
    offset = 0
    for i, (name, p) in enumerate(params.items()):
        assert (weights[offset:offset + p.numel()] == i).all(), name
        offset += p.numel()
    assert offset == t.n == n_params(arch.layout_for(t.cfg.model))
    t.train_step(0, *batches(1)[0])
    assert all(p.grad.untyped_storage().data_ptr() == t.state.grad.untyped_storage().data_ptr()
               for p in t.model.parameters())


def test_the_mlp_matches_the_gpts_parameters_and_the_presets_their_twins():
    assert [swiglu_hidden(c) for c in (64, 128, 320, 768)] == [192, 320, 832, 2048]
    for twin in ("andrea-12m", "andrea-120m"):
        gpt = n_params(arch.layout_for(configload.load(preset=twin).model))
        modern = configload.load(preset=f"{twin}-modern").model
        assert modern.arch == "modern" and configload.load(preset=f"{twin}-modern").train.optimizer == "normuon"
        # the twins' blocks, embedding and head (the value embeddings and smear the presets add: test_parts.py)
        layout = [s for s in arch.layout_for(modern) if not s.name.startswith(("value_embeds.", "smear."))
                  and "ve_gate" not in s.name]
        assert abs(sum(s.numel for s in layout) / gpt - 1) < 0.03, twin


def test_initialisation_is_seeded_and_starts_every_block_as_the_identity():
    a, b = (Trainer(modern_cfg(), torch.device("cpu")) for _ in range(2))
    assert torch.equal(a.state.w, b.state.w)
    assert not torch.equal(a.state.w, Trainer(modern_cfg(seed=7), torch.device("cpu")).state.w)
    params = dict(a.model.named_parameters())
    assert all(not params[f"h.{i}.{p}"].any() for i in range(2) for p in ("attn.o_proj.weight", "mlp.down_proj.weight"))
    assert float(params["wte.weight"].detach().std()) == pytest.approx(1.0, rel=0.05)
    x, y = batches(1)[0]
    assert float(a.loss_of(x, y)) == pytest.approx(math.log(300), abs=0.01)  # lm_head ~ N(0, 0.001)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_torch_math_is_the_kernels_references_forward_and_backward(dtype):
    """andrea/model/torch_math.py's one-pass RMSNorm, and its QK-norm-then-rotary over the fused projection, against
    andrea/kernels/'s references (autograd through them), on odd shapes and with per-row tables as the KV-cached
    decode gathers them: outputs and input gradients within fp32 rounding (bf16: one bf16 rounding of the output)."""
    from andrea.kernels.rmsnorm import rms_norm_reference
    from andrea.kernels.rotary import rotary_reference, rotary_tables
    from andrea.model.torch_math import qkv_heads, rms_norm
    gen = torch.Generator().manual_seed(3)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    cos, sin = rotary_tables(9, 10, 10000.0)  # (9, 5)
    rows = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [2, 3, 4, 5, 6, 7, 8], [1, 1, 2, 3, 5, 8, 8]])  # (3, 7) positions

    def reference_heads(x, c, s):  # (B, T, 3, nh, hs): the parts one at a time; per-row tables as (B, 1, T, hs/2)
        c, s = (t[:, None] if t.dim() == 3 else t for t in (c, s))
        q, k, v = x.unbind(2)
        return (rotary_reference(rms_norm_reference(q, 1e-6).transpose(1, 2), c, s),
                rotary_reference(rms_norm_reference(k, 1e-6).transpose(1, 2), c, s), v.transpose(1, 2))
    cases = ((lambda x: rms_norm(x, 1e-6), lambda x: rms_norm_reference(x, 1e-6), (3, 7, 37)),
             (lambda x: qkv_heads(x, cos[:7], sin[:7], 1e-6), lambda x: reference_heads(x, cos[:7], sin[:7]),
              (3, 7, 3, 2, 10)),
             (lambda x: qkv_heads(x, cos[rows], sin[rows], 1e-6), lambda x: reference_heads(x, cos[rows], sin[rows]),
              (3, 7, 3, 2, 10)))
    for ours, ref, shape in cases:
        x = (3 * torch.randn(shape, generator=gen)).to(dtype)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = ours(a), ref(b)
        ya, yb = (ya,) if torch.is_tensor(ya) else ya, (yb,) if torch.is_tensor(yb) else yb
        dys = [torch.randn(y.shape, generator=gen).to(dtype) for y in ya]
        torch.autograd.backward(ya, dys), torch.autograd.backward(yb, dys)
        assert a.grad.dtype == dtype and all(y.dtype == dtype for y in ya)
        for got, want in zip(ya, yb):
            torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(a.grad, b.grad, **tol)


def sharp(trainer: Trainer) -> Trainer:
    """Weights far from init (every block live, attention far from uniform) so positions and norms matter."""
    with torch.no_grad():
        trainer.state.w.copy_(0.3 * torch.randn(trainer.n, generator=torch.Generator().manual_seed(5)))
    trainer.model.eval()
    return trainer


def test_qk_norm_makes_attention_blind_to_the_scale_of_q_and_k():
    """q and k are RMS-normalised per head before rotary: scaling q_proj and k_proj changes nothing (up to eps),
    while scaling v_proj, which is not normalised, does."""
    t = sharp(Trainer(modern_cfg(), torch.device("cpu")))
    idx = batches(1)[0][0]
    before = t.model(idx)[0]
    params = dict(t.model.named_parameters())
    with torch.no_grad():
        for name in ("h.0.attn.q_proj.weight", "h.1.attn.k_proj.weight"):
            params[name].mul_(7.0)
    torch.testing.assert_close(t.model(idx)[0], before, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        params["h.0.attn.v_proj.weight"].mul_(7.0)
    assert (t.model(idx)[0] - before).abs().max() > 0.1


def test_norms_have_no_parameters_and_rotary_no_table():
    model = arch.build(modern_cfg().model)
    assert all("norm" not in name and "wpe" not in name for name, _ in model.named_parameters())
    assert not list(model.buffers())  # the rotary tables are computed, never saved


def test_triton_kernels_replace_the_math_not_the_parameters():
    """--kernels triton (the interpreter on CPU: the smallest shapes): RMSNorm, rotary, attention and the loss
    come from the kernels; the parameters, their order and the loss do not change beyond rounding."""
    from andrea.kernels import attention, rms_norm, rotary
    cfg = modern_cfg(model={"n_layer": 1, "block_size": 8}, batch_size=2)
    plain, fused = Trainer(cfg, torch.device("cpu")), Trainer(cfg, torch.device("cpu"), kernels="triton")
    block = fused.model.h[0]
    assert block.attn.attention is attention
    assert block.attn.qkv_heads.keywords == {"rms_norm": rms_norm, "rotary": rotary}  # QK-norm and rotary
    assert block.norm_1.fn is fused.model.norm_f.fn is rms_norm
    assert [n for n, _ in fused.model.named_parameters()] == [n for n, _ in plain.model.named_parameters()]
    sharp(plain), sharp(fused)
    x = batches(1, rows=2, T=8)[0][0]
    ours, theirs = fused.train_step(0, x, x), plain.train_step(0, x, x)  # every gradient through the kernels
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused.state.grad, plain.state.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("micro", [2, 4])
def test_micro_batches_follow_the_plain_run(micro):
    data = batches(4)
    plain = Trainer(modern_cfg(), torch.device("cpu"))
    ref = run_steps(plain, data)
    t = Trainer(modern_cfg(micro_batch_size=micro), torch.device("cpu"))
    got = run_steps(t, data)
    for (loss, norm), (ref_loss, ref_norm) in zip(got, ref):
        assert loss == pytest.approx(ref_loss, rel=LOSS_RTOL)
        assert norm == pytest.approx(ref_norm, rel=NORM_RTOL)
    assert (t.state.buffer - plain.state.buffer).abs().max() <= WEIGHT_ATOL  # w, m and v
    assert not torch.equal(plain.state.w, Trainer(modern_cfg(), torch.device("cpu")).state.w)  # it trained


def test_activation_checkpointing_recomputes_the_blocks_and_gives_the_same_bytes():
    data = batches(2)
    plain = Trainer(modern_cfg(), torch.device("cpu"))
    ck = Trainer(modern_cfg(activation_checkpointing="blocks"), torch.device("cpu"))
    calls, forward = [0], ck.model.h[0].forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)
    ck.model.h[0].forward = counted
    assert run_steps(plain, data) == run_steps(ck, data)
    assert torch.equal(plain.state.buffer, ck.state.buffer)
    assert calls[0] == 2 * len(data)  # each step ran block 0 twice: forward, and again in the backward


@pytest.mark.parametrize("ac, extras", [("none", {}), ("blocks", {}), ("none", {"mlp": "relu2"}),
                                        ("blocks", {"mlp": "relu2", "embed_norm": True, "logit_softcap": 15.0})])
def test_the_memory_estimate_counts_what_autograd_saves(ac, extras):
    """As the GPT's (tests/e2e/test_microbatch.py): activations and log-probabilities within 3 %; under
    checkpointing the estimate also counts the one block recomputed at a time, which the forward does not save.
    The model extras too (ReLU²'s MLP, the embedding norm, the softcap's tanh)."""
    t = Trainer(modern_cfg({"n_layer": 3, "n_head": 4, "n_embd": 64, "block_size": 32, "vocab_size": 512, **extras},
                           activation_checkpointing=ac), torch.device("cpu"))
    rows, tokens = 4, 4 * 32
    x, y = (torch.randint(0, 512, (rows, 32), generator=torch.Generator().manual_seed(1)) for _ in range(2))
    est = memory.estimate(t.cfg.model, t.n, rows, activation_checkpointing=ac, device="cpu")
    inside = (tokens * memory.block_bytes_per_token(t.cfg.model, "cpu") + memory.block_weight_bytes(t.cfg.model, "cpu")
              if ac == "blocks" else 0)
    # the loss saves its fp32 log-probabilities (est.logits also counts their gradient, made in the backward)
    assert saved_bytes(t, x, y) == pytest.approx(est.activations - inside + est.logits - tokens * 512 * 4, rel=0.03)


# --- generation ----------------------------------------------------------------------------------------------------
PROMPTS = [[11, 2, 3], [7], [5, 6, 7, 8, 9, 10, 11]]  # unequal: left padding shifts the rows' positions


def rms64(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rotary64(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def fp64_copy(trainer: Trainer) -> Modern:
    ops = ModelMath(rms_norm=rms64, qkv_heads=partial(split_heads, rms_norm=rms64, rotary=rotary64))
    model = Modern(trainer.cfg.model, ops).double().eval()
    model.load_state_dict({k: v.double() for k, v in trainer.model.state_dict().items()})
    return model


def logits_of(decode, model, tokens: list[list[int]]) -> torch.Tensor:
    seen: list[torch.Tensor] = []

    def teacher(logits: torch.Tensor) -> list[int]:  # records every step's logits, feeds the given continuation
        seen.append(logits.double().clone())
        return [row[len(seen) - 1] for row in tokens]
    assert decode(model, PROMPTS, len(tokens[0]), teacher) == tokens
    return torch.stack(seen)  # (n_new, B, V)


@pytest.mark.parametrize("n_new", [5, 20])  # 20: rows of 7 + 20 and 3 + 20 tokens cross block_size 16
def test_cached_logits_match_the_uncached_loop_within_its_own_rounding(n_new):
    t = sharp(Trainer(modern_cfg(), torch.device("cpu")))
    tokens = torch.randint(0, 300, (len(PROMPTS), n_new), generator=torch.Generator().manual_seed(0)).tolist()
    cached = logits_of(generation.decode, t.model, tokens)
    uncached = logits_of(generation.decode_uncached, t.model, tokens)
    exact = logits_of(generation.decode_uncached, fp64_copy(t), tokens)
    err_cached, err_uncached = (cached - exact).abs().max(), (uncached - exact).abs().max()
    assert exact.abs().max() > 5  # sharp enough for positions to matter
    assert err_uncached < 1e-3 and err_cached <= 4 * err_uncached, (err_cached, err_uncached)


def test_a_cache_without_rotary_positions_is_caught_by_that_tolerance(monkeypatch):
    """Rotary at the wrong positions (every slot at position 0) fails the tolerance above."""
    t = sharp(Trainer(modern_cfg(), torch.device("cpu")))
    tokens = torch.randint(0, 300, (len(PROMPTS), 5), generator=torch.Generator().manual_seed(0)).tolist()
    exact = logits_of(generation.decode_uncached, fp64_copy(t), tokens)
    real_init = generation.KVCache.__init__

    def no_positions(self, *args):
        real_init(self, *args)
        self.pos.zero_()
    monkeypatch.setattr(generation.KVCache, "__init__", no_positions)
    assert (logits_of(generation.decode, t.model, tokens) - exact).abs().max() > 1e-2


def test_greedy_cached_generation_equals_the_full_forwards_argmax():
    t = sharp(Trainer(modern_cfg(), torch.device("cpu")))
    gens = [torch.Generator().manual_seed(r) for r in range(len(PROMPTS))]
    reference = generation.decode_uncached(t.model, PROMPTS, 24, generation.sampler(1.0, 1, gens))
    assert t.generate(PROMPTS, 24, temperature=1.0, top_k=1, generators=gens) == reference
    assert len({tuple(r) for r in reference}) == len(PROMPTS)  # not a degenerate constant continuation
