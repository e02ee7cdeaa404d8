"""The modern model's extras (andrea/model/modern.py; ModelConfig's logit_softcap, embed_norm, qk_scale, mlp), each
against a plain reference computed here from the same weights: the softcap bounds the logits as c·tanh(x/c), the
q/k scale multiplies attention's logits by scale², the embedding norm gives the first block unit-RMS rows, ReLU²
is down(relu(up x)²) with no gate matrix. Their defaults are today's model (tests/unit/optim/test_default_bytes.py
holds the bytes); a gpt2 model refuses them; generation's cached loop applies them as the forward does."""

from __future__ import annotations

import pytest
import torch

from andrea.config import load as configload
from andrea.config.check import ConfigError
from andrea.config.schema import ModelConfig
from andrea.model import arch, generate as generation
from andrea.model.gpt import ModelMath, n_params, sdpa_attention
from andrea.model.modern import Modern
from tests.unit.model.live import live_model, tokens

SHAPE = {"arch": "modern", "n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 300}


def model_of(ops: ModelMath = ModelMath(), seed: int = 5, **extras) -> Modern:
    """A modern model with `extras`, every weight N(0, 0.3²) from `seed` (far from init: blocks live, logits large)."""
    return live_model({**SHAPE, **extras}, ops, seed)


@torch.no_grad()
def test_softcap_is_c_tanh_of_the_plain_logits_and_bounds_them():
    idx = tokens()
    plain = model_of()(idx)[0]
    capped = model_of(logit_softcap=2.0)(idx)[0]
    assert plain.abs().max() > 4  # the cap has something to bound
    assert capped.abs().max() < 2.0
    torch.testing.assert_close(capped, 2.0 * torch.tanh(plain / 2.0))


def test_softcap_enters_the_loss():
    idx = tokens()
    with torch.no_grad():
        logits = model_of()(idx)[0]
        loss = model_of(logit_softcap=2.0)(idx, idx)[1]
    want = torch.nn.functional.cross_entropy((2.0 * torch.tanh(logits / 2.0)).flatten(0, 1), idx.flatten(),
                                             reduction="none").view(idx.shape).mean(1)
    torch.testing.assert_close(loss, want)


def recorded_scores(**extras) -> list[torch.Tensor]:
    """q·kᵀ of every attention call of a forward (each (B, nh, T, T))."""
    seen: list[torch.Tensor] = []

    def attention(q, k, v):
        seen.append(q @ k.transpose(-1, -2))
        return sdpa_attention(q, k, v)
    with torch.no_grad():
        model_of(ModelMath(attention=attention), **extras)(tokens())
    return seen


def test_qk_scale_multiplies_the_attention_logits_by_its_square():
    plain, scaled = recorded_scores(), recorded_scores(qk_scale=1.2)
    assert len(plain) == len(scaled) == SHAPE["n_layer"]
    # layer 0 sees the same input; layer 1's input differs because layer 0's attention sharpened
    torch.testing.assert_close(scaled[0], 1.44 * plain[0])
    assert (scaled[1] - 1.44 * plain[1]).abs().max() > 1e-3


@torch.no_grad()
def test_embed_norm_gives_the_first_block_unit_rms_rows():
    seen: list[torch.Tensor] = []
    for on in (False, True):
        model = model_of(embed_norm=on)
        model.h[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        model(tokens())
    plain, normed = seen
    rms = lambda x: x.pow(2).mean(-1).sqrt()  # noqa: E731
    assert (rms(plain) - 1).abs().max() > 0.5  # the embedding's rows are not unit-RMS by themselves
    torch.testing.assert_close(rms(normed), torch.ones_like(rms(normed)), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(normed, plain * torch.rsqrt(plain.pow(2).mean(-1, keepdim=True) + 1e-6))


def test_relu2_has_no_gate_and_is_down_of_relu_up_squared():
    cfg = ModelConfig(**SHAPE, mlp="relu2")
    model = model_of(mlp="relu2")
    names = [n for n, _ in model.named_parameters() if ".mlp." in n]
    assert names == [f"h.{i}.mlp.{p}_proj.weight" for i in range(2) for p in ("up", "down")]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["h.0.mlp.up_proj.weight"] == (128, 32) and shapes["h.0.mlp.down_proj.weight"] == (32, 128)
    mlp = model.h[0].mlp
    x = torch.randn(4, 5, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = x @ mlp.up_proj.weight.double().T
    want = torch.where(want > 0, want * want, torch.zeros_like(want)) @ mlp.down_proj.weight.double().T
    with torch.no_grad():
        torch.testing.assert_close(mlp(x.float()).double(), want, rtol=1e-5, atol=1e-5)
    flat = arch.init_weights(arch.layout_for(cfg), cfg, 0)
    spec = {s.name: s for s in arch.layout_for(cfg)}["h.0.mlp.down_proj.weight"]
    assert not flat[spec.offset:spec.offset + spec.numel].any()  # down starts at zero: the block is the identity
    assert n_params(arch.layout_for(cfg)) != n_params(arch.layout_for(ModelConfig(**SHAPE)))


@pytest.mark.parametrize("key, value", [("logit_softcap", 15.0), ("embed_norm", True), ("qk_scale", 1.2),
                                        ("mlp", "relu2")])
def test_a_gpt2_model_refuses_an_extra_in_one_line(key, value):
    with pytest.raises(ConfigError) as e:
        configload.from_dict({"model": {**SHAPE, "arch": "gpt2", key: value}})
    assert key in str(e.value) and "\n" not in str(e.value)
    configload.from_dict({"model": {**SHAPE, key: value}})  # the modern model takes it


@pytest.mark.parametrize("model", [{"mlp": "gelu"}, {"logit_softcap": -1.0}, {"qk_scale": 0.0}])
def test_bad_extras_are_refused(model):
    with pytest.raises(ConfigError):
        configload.from_dict({"model": {**SHAPE, **model}})


def test_cached_generation_applies_every_extra_as_the_forward_does():
    extras = {"logit_softcap": 3.0, "embed_norm": True, "qk_scale": 1.2, "mlp": "relu2", "rope_base": 1e5}
    model = model_of(**extras)
    prompt = tokens(1, 9)
    seen: list[torch.Tensor] = []

    def greedy(logits: torch.Tensor) -> list[int]:
        seen.append(logits.clone())
        return logits.argmax(-1).tolist()
    out = generation.decode(model, prompt.tolist(), 4, greedy)
    with torch.no_grad():
        full = model(torch.cat([prompt, torch.tensor(out)[:, :3]], dim=1))[0]  # (1, 12, V)
    for i, logits in enumerate(seen):
        torch.testing.assert_close(logits[0], full[0, 8 + i], rtol=1e-4, atol=1e-4)
    assert full.abs().max() < 3.0  # the cap reached the forward that decode is held to
