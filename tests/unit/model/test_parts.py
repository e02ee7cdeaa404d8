"""The modern model's parts with parameters (andrea/model/modern.py; ModelConfig's value_embeds, resid_lambdas, smear,
backout), each against a reference computed here from the same weights: the value embedding enters v gated per
head by 3·sigmoid over the first 12 channels, block i's input is r_i·x + a_i·x0, smear adds the gated previous
embedding (none at position 0), backout subtracts β × the stream after the middle block. Their parameters sit where
docs/formats.md says and start at nanochat's values; NorMuon gives each its own AdamW group, which the guard's lr
scale reaches; generation's cached loop applies them as the forward does, left padding included."""

from __future__ import annotations

import pytest
import torch

from andrea.config import load as configload
from andrea.config.check import ConfigError
from andrea.config.schema import ModelConfig
from andrea.control.run.trainer import Trainer
from andrea.kernels import adamw_reference
from andrea.model import arch, generate as generation, memory
from andrea.model.gpt import ModelMath, n_params, sdpa_attention
from andrea.model.modern import Modern
from tests.unit.model.live import live_model, tokens
from andrea.optim.normuon import NorMuon
from andrea.optim.registry import Hyper
from tests.activations import saved_bytes

SHAPE = {"arch": "modern", "n_layer": 3, "n_head": 2, "n_embd": 32, "block_size": 16, "vocab_size": 300}
ALL = {"value_embeds": True, "resid_lambdas": True, "smear": True, "backout": True}
CPU = torch.device("cpu")


def model_of(ops: ModelMath = ModelMath(), seed: int = 5, **parts) -> Modern:
    """A modern model with `parts`, every weight N(0, 0.3²) from `seed` (far from init: every part live)."""
    return live_model({**SHAPE, **parts}, ops, seed)


def inputs_of(model: Modern, idx: torch.Tensor) -> list[torch.Tensor]:
    """Each block's input (B, T, C) in one forward."""
    seen: list[torch.Tensor] = []
    hooks = [b.register_forward_pre_hook(lambda _m, args: seen.append(args[0])) for b in model.h]
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    return seen


def test_each_part_adds_its_parameters_where_the_format_says_and_nothing_else_moves():
    plain = [s.name for s in arch.layout_for(ModelConfig(**SHAPE))]
    layout = arch.layout_for(ModelConfig(**SHAPE, **ALL))
    names = [s.name for s in layout]
    # the plain model's parameters keep their relative order; layers 0 and 2 of 3 have value embeddings
    assert [n for n in names if n in plain] == plain
    assert names[names.index("h.0.attn.o_proj.weight") + 1] == "h.0.attn.ve_gate.weight"
    assert "h.1.attn.ve_gate.weight" not in names
    assert names[names.index("lm_head.weight"):] == [
        "lm_head.weight", "value_embeds.0.weight", "value_embeds.2.weight", "lambdas.resid", "lambdas.x0",
        "smear.lam", "smear.gate.weight", "backout.lam"]
    shapes = {s.name: s.shape for s in layout}
    assert shapes["h.2.attn.ve_gate.weight"] == (2, 12) and shapes["value_embeds.2.weight"] == (300, 32)
    assert shapes["lambdas.resid"] == shapes["lambdas.x0"] == (3,) and shapes["smear.gate.weight"] == (1, 24)
    base = n_params(arch.layout_for(ModelConfig(**SHAPE)))
    added = {part: n_params(arch.layout_for(ModelConfig(**SHAPE, **{part: True}))) - base for part in ALL}
    assert added == {"value_embeds": 2 * (2 * 12 + 300 * 32), "resid_lambdas": 6, "smear": 25, "backout": 1}


def test_the_parts_start_at_nanochats_values_and_the_plain_weights_stay_as_they_were():
    cfg = ModelConfig(**SHAPE, **ALL)
    layout = arch.layout_for(cfg)
    flat = arch.init_weights(layout, cfg, 0)
    at = {s.name: flat[s.offset:s.offset + s.numel] for s in layout}
    torch.testing.assert_close(at["lambdas.resid"], torch.tensor([1.15, 1.10, 1.05]))
    torch.testing.assert_close(at["lambdas.x0"], torch.tensor([0.20, 0.125, 0.05]))
    assert at["smear.lam"].tolist() == [0.0] and at["backout.lam"].tolist() == pytest.approx([0.2])
    for gate in ("smear.gate.weight", "h.0.attn.ve_gate.weight"):
        assert 0.0 <= float(at[gate].min()) and float(at[gate].max()) <= 0.02 and bool(at[gate].any())
    bound = (3 / 32) ** 0.5
    assert float(at["value_embeds.0.weight"].abs().max()) <= bound and float(at["value_embeds.0.weight"].std()) > 0.1
    # wte draws first in both: the plain model's embedding is the same bytes
    plain_cfg = ModelConfig(**SHAPE)
    plain = arch.init_weights(arch.layout_for(plain_cfg), plain_cfg, 0)
    assert torch.equal(plain[:300 * 32], at["wte.weight"])


@torch.no_grad()
def test_the_value_embedding_enters_v_gated_per_head():
    """Layer 0's v with the value embedding minus its v with that embedding zeroed (the same input: layer 0 is
    the first) is gate · ve, the gate 3·sigmoid(ve_gate · x[..., :12]) per head, x the attention's input."""
    idx = tokens()
    seen: dict[str, list[torch.Tensor]] = {"on": [], "off": []}
    attn_in: list[torch.Tensor] = []
    for key in ("on", "off"):
        def attention(q, k, v, into=seen[key]):
            into.append(v)
            return sdpa_attention(q, k, v)
        model = model_of(ModelMath(attention=attention), value_embeds=True)
        model.h[0].attn.register_forward_pre_hook(lambda _m, args: attn_in.append(args[0]))
        if key == "on":
            ve = model.value_embeds["0"].weight[idx].view(3, 16, 2, 16)  # (B, T, nh, hs)
        else:
            model.value_embeds["0"].weight.zero_()
        model(idx)
    x = attn_in[0]  # the first attention's input (B, T, C)
    gate = 3 * torch.sigmoid(x[..., :12] @ model.h[0].attn.ve_gate.weight.T)  # (B, T, nh)
    want = (gate[..., None] * ve).transpose(1, 2)  # (B, nh, T, hs)
    assert want.abs().max() > 0.1
    torch.testing.assert_close(seen["on"][0] - seen["off"][0], want, rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_block_inputs_are_the_lambdas_mix_of_the_stream_and_x0():
    model = model_of(resid_lambdas=True)
    model.lambdas.resid.copy_(torch.tensor([1.0, 0.5, 2.0]))
    model.lambdas.x0.copy_(torch.tensor([0.0, 2.0, -1.0]))
    outs: list[torch.Tensor] = []
    for b in model.h:
        b.register_forward_hook(lambda _m, _a, out: outs.append(out))
    seen = inputs_of(model, tokens())
    x0 = model.wte(tokens())
    torch.testing.assert_close(seen[0], x0)
    torch.testing.assert_close(seen[1], 0.5 * outs[0] + 2.0 * x0)
    torch.testing.assert_close(seen[2], 2.0 * outs[1] - x0)


@torch.no_grad()
def test_smear_adds_the_gated_previous_embedding_and_nothing_at_position_zero():
    model = model_of(smear=True)
    idx = tokens()
    e = model.wte(idx)  # (B, T, C)
    got = inputs_of(model, idx)[0]
    gate = model.smear.lam * torch.sigmoid(e[..., :24] @ model.smear.gate.weight.T)  # (B, T, 1)
    torch.testing.assert_close(got[:, 0], e[:, 0])
    torch.testing.assert_close(got[:, 1:], e[:, 1:] + gate[:, 1:] * e[:, :-1])
    assert (got[:, 1:] - e[:, 1:]).abs().max() > 0.05


@torch.no_grad()
def test_backout_subtracts_beta_times_the_middle_stream_before_the_final_norm():
    model = model_of(backout=True)
    outs: list[torch.Tensor] = []
    for b in model.h:
        b.register_forward_hook(lambda _m, _a, out: outs.append(out))
    logits = model(tokens())[0]
    middle = outs[SHAPE["n_layer"] // 2]
    x = outs[-1] - model.backout.lam * middle
    want = model.lm_head(x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    plain = model.lm_head(model.norm_f(outs[-1]))
    assert (plain - logits).abs().max() > 1e-2


@pytest.mark.parametrize("part", list(ALL))
def test_a_gpt2_model_refuses_a_part_in_one_line(part):
    with pytest.raises(ConfigError) as e:
        configload.from_dict({"model": {**SHAPE, "arch": "gpt2", part: True}})
    assert part in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("part, width", [("value_embeds", 8), ("smear", 16)])
def test_a_gate_wider_than_the_model_is_refused(part, width):
    with pytest.raises(ConfigError, match=f"model.{part}"):
        configload.from_dict({"model": {**SHAPE, "n_embd": width, "n_head": 2, part: True}})


def test_cached_generation_applies_every_part_as_the_forward_does_left_padding_included():
    model = model_of(**ALL, logit_softcap=3.0, embed_norm=True)
    prompts = [tokens(1, 9)[0].tolist(), tokens(1, 5)[0, 4:].tolist()]  # 9 and 1 tokens: row 1 left-padded
    seen: list[torch.Tensor] = []

    def greedy(logits: torch.Tensor) -> list[int]:
        seen.append(logits.clone())
        return logits.argmax(-1).tolist()
    out = generation.decode(model, prompts, 4, greedy)
    with torch.no_grad():
        for r, prompt in enumerate(prompts):
            full = model(torch.tensor([prompt + out[r][:3]]))[0][0]  # (len, V)
            for i, logits in enumerate(seen):
                torch.testing.assert_close(logits[r], full[len(prompt) - 1 + i], rtol=1e-4, atol=1e-4)


# --- NorMuon's groups (andrea/optim/normuon.py PARTS) ----------------------------------------------------------------
def tiny(*overrides: str):
    return configload.load(preset="andrea-tiny", overrides=[
        "train.optimizer=normuon", "model.arch=modern", "model.n_layer=2", "model.n_embd=32", "model.n_head=2",
        "model.vocab_size=260", "model.block_size=16", *[f"model.{k}=true" for k in ALL], *overrides])


# (the --set items, each group's (lr, beta1, beta2, weight decay) they make): nanochat's values by default
# (its gpt.py setup_optimizer: the value embeddings at half embed_lr, scalar_lr 0.5), else each group's own keys
WIDTH_SCALE = (768 / 32) ** 0.5  # lr_width / n_embd: the value embeddings' lr is width-scaled, the scalars' not
GROUPS = {
    "nanochat's": ((), {"value_embeds.1.weight": (0.15 * WIDTH_SCALE, 0.8, 0.995, 0.01),
                        "lambdas.resid": (0.005, 0.8, 0.95, 0.05), "lambdas.x0": (0.5, 0.96, 0.95, 0.0),
                        "smear.lam": (0.2, 0.8, 0.95, 0.0), "smear.gate.weight": (0.2, 0.8, 0.95, 0.0),
                        "backout.lam": (0.2, 0.8, 0.95, 0.0)}),
    "set": (("train.value_embed_lr=0.05", "train.value_embed_weight_decay=0.2", "train.embed_beta1=0.7",
             "train.resid_lr=0.01", "train.resid_beta1=0.5", "train.resid_beta2=0.6", "train.resid_weight_decay=0.3",
             "train.x0_lr=0.25", "train.x0_beta1=0.85", "train.x0_beta2=0.75", "train.x0_weight_decay=0.1",
             "train.smear_lr=0.125", "train.smear_beta1=0.65", "train.smear_beta2=0.55",
             "train.smear_weight_decay=0.4"),
            {"value_embeds.1.weight": (0.05 * WIDTH_SCALE, 0.7, 0.995, 0.2),
             "lambdas.resid": (0.01, 0.5, 0.6, 0.3), "lambdas.x0": (0.25, 0.85, 0.75, 0.1),
             "smear.lam": (0.125, 0.65, 0.55, 0.4), "smear.gate.weight": (0.125, 0.65, 0.55, 0.4),
             "backout.lam": (0.125, 0.65, 0.55, 0.4)}),
}


@pytest.mark.parametrize("values", list(GROUPS))
def test_each_part_takes_its_own_adamw_group_at_the_guards_scale(values):
    """Each part's AdamW group has its own lr, betas and weight decay (train keys, nanochat's by default), its
    decay reaching its vectors too, and the guard's scale reaches it."""
    overrides, groups = GROUPS[values]
    cfg = tiny("train.grad_clip=0", *overrides)
    tc, layout = cfg.train, arch.layout_for(cfg.model)
    n = n_params(layout)
    gen = torch.Generator().manual_seed(2)
    w, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    got = [w.clone(), g.clone(), torch.zeros(n), torch.zeros(n)]
    ratio = 0.5  # the schedule's and the guard's scale: hp.lr / train.lr
    NorMuon(layout, tc, adamw_reference, "torch", CPU)(*got, Hyper(1, tc.lr * ratio, tc.beta1, tc.beta2, tc.eps,
                                                                   tc.weight_decay, None))
    for name, (lr, b1, b2, wd) in groups.items():
        s = next(p for p in layout if p.name == name)
        r = slice(s.offset, s.offset + s.numel)
        want = [w[r].clone(), g[r].clone(), torch.zeros(s.numel), torch.zeros(s.numel)]
        adamw_reference(*want, step=1, lr=lr * ratio, beta1=b1, beta2=b2, eps=tc.group_eps, weight_decay=wd,
                        decay_mask=None)  # every element decays, a vector's too
        for a, b in zip((got[0][r], got[2][r], got[3][r]), (want[0], want[2], want[3])):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("optimizer", ["normuon", "muon", "adamw"])
def test_every_optimizer_trains_the_parts_and_the_guards_scale_halves_their_change(optimizer):
    """A first step from the same state and batch at lr scale 1 and 0.5 (the guard's remedy; no decay, no clip):
    every part's parameters move, by half as much at half the scale."""
    cfg = tiny(f"train.optimizer={optimizer}", "train.grad_clip=0", "train.weight_decay=0",
               "train.embed_weight_decay=0", "train.head_weight_decay=0", "train.muon_weight_decay=0",
               "train.warmup_steps=1")
    x = torch.randint(0, cfg.model.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    changes = []
    for scale in (1.0, 0.5):
        trainer = Trainer(cfg, CPU, kernels="torch")
        gen = torch.Generator().manual_seed(3)  # every weight live, so every part has a gradient at step 0
        trainer.state.w.copy_(0.3 * torch.randn(trainer.state.w.shape, generator=gen))
        trainer.lr_scale = scale
        w0 = trainer.state.w.clone()
        trainer.train_step(0, x, torch.roll(x, -1, dims=1))
        changes.append(trainer.state.w - w0)
    parts = [s for s in trainer.layout if s.name.startswith(("value_embeds.", "lambdas.", "smear.", "backout."))
             or "ve_gate" in s.name]
    assert len(parts) == 7  # n_layer 2: one value embedding (layer 1) and its gate
    for s in parts:
        r = slice(s.offset, s.offset + s.numel)
        assert float(changes[0][r].abs().max()) > 0, s.name
        assert float(changes[1][r].norm() / changes[0][r].norm()) == pytest.approx(0.5, rel=1e-3), s.name


@pytest.mark.parametrize("part", list(ALL))
def test_the_memory_estimate_counts_what_each_part_makes_autograd_save(part):
    """`info`'s estimate grows by what autograd saves for the part (saved-tensor hooks), to the byte."""
    base = {**SHAPE, "n_head": 4, "block_size": 32}
    x, y = (torch.randint(0, 300, (4, 32), generator=torch.Generator().manual_seed(1)) for _ in range(2))
    saved, est = [], []
    for parts in ({}, {part: True}):
        cfg = configload.from_dict({"model": {**base, **parts}})
        trainer = Trainer(cfg, CPU, kernels="torch")
        saved.append(saved_bytes(trainer, x, y))
        est.append(memory.estimate(cfg.model, trainer.n, 4, device="cpu").activations)
    assert est[1] - est[0] == saved[1] - saved[0]


@pytest.mark.parametrize("optimizer", ["normuon", "muon"])
def test_a_resume_from_the_flat_state_is_bit_for_bit_with_every_part(optimizer):
    """The parts' weights and their m and v live in the flat [w | m | v]: six steps straight equal three, the
    state loaded into a new trainer, and three more, byte for byte."""
    cfg = tiny(f"train.optimizer={optimizer}", "train.warmup_steps=2", "train.lr_decay_steps=8")
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, cfg.model.vocab_size, (4, 16), generator=gen) for _ in range(6)]

    def run(t: Trainer, steps) -> None:
        for s in steps:
            t.train_step(s, batches[s], torch.roll(batches[s], -1, dims=1))

    straight = Trainer(cfg, CPU, kernels="torch")
    run(straight, range(6))
    first = Trainer(cfg, CPU, kernels="torch")
    run(first, range(3))
    resumed = Trainer(cfg, CPU, kernels="torch")
    resumed.load(first.state.buffer.clone())
    run(resumed, range(3, 6))
    assert torch.equal(resumed.state.buffer, straight.state.buffer)
    smear = next(s for s in straight.layout if s.name == "smear.lam")
    assert float(straight.state.w[smear.offset]) != 0.0  # the parts trained (smear's λ starts at 0)


def test_slices_cut_inside_the_parts_update_them_as_the_whole():
    """NorMuon over slices of the flat state (as ZeRO-1's ranks hold them) cut inside a value embedding and
    between the resid lambdas gives the whole update's bytes on each slice: the parts' groups and resid's decay
    mask follow the cut."""
    cfg = tiny()
    tc, layout = cfg.train, arch.layout_for(cfg.model)
    n = n_params(layout)
    at = {s.name: s.offset for s in layout}
    cuts = [0, at["value_embeds.1.weight"] + 1000, at["lambdas.resid"] + 1, n]
    hp = Hyper(3, 1e-3, tc.beta1, tc.beta2, tc.eps, tc.weight_decay, None, progress=0.2)
    gen = torch.Generator().manual_seed(5)
    whole = [torch.randn(n, generator=gen), torch.randn(n, generator=gen), torch.randn(n, generator=gen),
             torch.rand(n, generator=gen)]
    parts_in = [t.clone() for t in whole]
    NorMuon(layout, tc, adamw_reference, "torch", CPU)(*whole, hp)
    for lo, hi in zip(cuts, cuts[1:]):
        part = [t[lo:hi].clone() for t in parts_in]
        NorMuon(layout, tc, adamw_reference, "torch", CPU, lo, hi)(*part, hp)
        for a, b in zip(part, whole):
            assert torch.allclose(a, b[lo:hi], rtol=0, atol=1e-6)


def test_the_triton_kernels_and_block_recomputation_carry_the_parts():
    """--kernels triton (the interpreter on CPU) computes the parts around the kernels: the loss and every
    gradient, the parts' included, as torch's; activation checkpointing recomputes the blocks (value embedding
    in) to the same bytes."""
    cfg = tiny("model.n_layer=1", "model.block_size=8", "train.batch_size=2")
    x = torch.randint(0, cfg.model.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, dims=1)
    sharp = 0.3 * torch.randn(n_params(arch.layout_for(cfg.model)), generator=torch.Generator().manual_seed(3))
    plain, fused = Trainer(cfg, CPU), Trainer(cfg, CPU, kernels="triton")
    ck = Trainer(configload.load(preset="andrea-tiny", overrides=[
        *[f"{k}={v}" for k, v in (("train.optimizer", "normuon"), ("train.activation_checkpointing", "blocks"))],
        "model.arch=modern", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.vocab_size=260",
        "model.block_size=8", "train.batch_size=2", *[f"model.{k}=true" for k in ALL]]), CPU)
    for t in (plain, fused, ck):
        t.state.w.copy_(sharp)
    ours, theirs = fused.train_step(0, x, y), plain.train_step(0, x, y)
    torch.testing.assert_close(ours.loss, theirs.loss, rtol=1e-5, atol=1e-5)
    # (the plain model on these weights differs by up to 1.3e-5 too: the kernels' summation order)
    torch.testing.assert_close(fused.state.grad, plain.state.grad, rtol=1e-4, atol=5e-5)
    for s in plain.layout:  # the parts' gradients (of max 0.004 to 0.4) to 1e-6
        if not s.name.startswith(("h.", "wte", "lm_head")):
            r = slice(s.offset, s.offset + s.numel)
            torch.testing.assert_close(fused.state.grad[r], plain.state.grad[r], rtol=1e-4, atol=1e-6)
    ve = next(s for s in plain.layout if s.name == "value_embeds.0.weight")
    assert plain.state.grad[ve.offset:ve.offset + ve.numel].abs().max() > 0
    ck.train_step(0, x, y)
    assert torch.equal(ck.state.buffer, plain.state.buffer)


@pytest.mark.parametrize("parts", [ALL, {"value_embeds": True}, {"resid_lambdas": True, "backout": True}])
def test_the_mfu_count_leaves_the_parts_lookups_out_and_equals_torchs(parts):
    """MFU's FLOPs per token (andrea/control/observe/mfu.py): the value-embedding tables and the scalars are no
    matmul weights (the gates are), so the count is torch's to the FLOP, as for the plain modern model."""
    from torch.utils.flop_counter import FlopCounterMode
    from andrea.control.observe import mfu
    from andrea.kernels.attention import attention_reference
    cfg = ModelConfig(**SHAPE, **parts)
    model = Modern(cfg, ModelMath(attention=attention_reference))
    B, T = 3, cfg.block_size
    with FlopCounterMode(display=False) as counter:
        logits, _ = model(torch.randint(0, cfg.vocab_size, (B, T)))
        logits.float().square().mean().backward()
    assert mfu.model_flops_per_token(cfg, n_params(arch.layout_for(cfg))) == counter.get_total_flops() / (B * T)


def test_the_modern_presets_take_the_parts_that_paid_and_an_older_run_keeps_its_model():
    """andrea-12m-modern and andrea-120m-modern turn value_embeds and smear on (docs/benchmarks.md: -0.12 together
    under NorMuon, -0.07 under Muon at issue 54's setup), not resid_lambdas or backout (+0.12, -0.006); a run.toml
    written before the keys existed reads as the model it trained (off)."""
    for name in ("andrea-12m-modern", "andrea-120m-modern"):
        m = configload.load(preset=name).model
        assert (m.value_embeds, m.smear, m.resid_lambdas, m.backout) == (True, True, False, False), name
    old = {k: v for k, v in vars(configload.load(preset="andrea-12m-modern").model).items()
           if k not in ("value_embeds", "resid_lambdas", "smear", "backout")}
    m = configload.load(base={"model": old}).model
    assert not (m.value_embeds or m.smear)
    m = configload.load(preset="andrea-12m-modern", base={"model": old}).model  # resumed naming the preset again
    assert not (m.value_embeds or m.smear)
    m = configload.load(preset="andrea-12m-modern", base={"model": {"n_layer": 2}}).model  # no run's record
    assert m.value_embeds and m.smear
