"""A modern run (model.arch = "modern") end to end: trained by a real process with its sample audits, sampled and
evaluated from its checkpoint, exported as a Hugging Face Qwen3ForCausalLM directory (andrea/model/export.py,
andrea/model/qwen3.py) that a stock `transformers` class loads without custom code with andrea's logits, and read
back by `train --init-from` bit for bit; norm weights that are not ones are refused.

One short tiny-preset modern run is trained and exported once per module; the rest reads it in-process.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from andrea.cli import main as cli_main
from andrea.config.load import run_config
from andrea.model import arch, export, init_from
from andrea.model.gpt import n_params
from andrea.rundir import checkpoint as ckpt, names
from tests.runs import ROOT, ledger, seed_data, train

transformers = pytest.importorskip("transformers", reason="transformers is a test extra: pip install -e '.[test]'")

STEPS = 20
TASKS = ROOT / "tests" / "tasks" / "memorized.jsonl"
MODERN = ("--set", 'model.arch="modern"')


@pytest.fixture(scope="module")
def run(prepared, tmp_path_factory):
    root = tmp_path_factory.mktemp("export_modern")
    run_dir = seed_data(prepared, root / "run")
    result = train(run_dir, *MODERN, "--steps", str(STEPS), "--set", f"sample.every={STEPS}")
    assert result.returncode == 0, result.stderr
    out = root / "hf"
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
    cfg = run_config(run_dir)
    layout = arch.layout_for(cfg.model)
    n = n_params(layout)
    _, payload = ckpt.read_payload(run_dir / names.checkpoint_name(STEPS), n)
    tokens = np.fromfile(next((run_dir / "data").glob("*.val.u16")), dtype="<u2").astype(np.int64)
    T = cfg.model.block_size
    idx = torch.from_numpy(np.stack([tokens[:T], tokens[T:2 * T]]))  # (2, T) real text
    return SimpleNamespace(dir=run_dir, out=out, cfg=cfg, layout=layout, n=n, weights=payload[:n].copy(), idx=idx)


def andrea_model(run) -> torch.nn.Module:
    """andrea's modern model (torch math, as `--kernels torch` trains it) holding the run's weights."""
    model = arch.build(run.cfg.model).eval()
    params = dict(model.named_parameters())
    for s in run.layout:
        params[s.name].data.copy_(torch.from_numpy(run.weights[s.offset:s.offset + s.numel]).view(s.shape))
    return model


def test_a_stock_qwen3_loads_every_tensor_untied_and_gives_andreas_logits(run):
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM
    hf, info = AutoModelForCausalLM.from_pretrained(run.out, output_loading_info=True)
    assert type(hf) is Qwen3ForCausalLM  # the stock class, from config.json alone
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set()), info
    hf.eval()
    ours = andrea_model(run)
    assert torch.equal(hf.lm_head.weight, ours.lm_head.weight)
    assert hf.lm_head.weight.data_ptr() != hf.model.embed_tokens.weight.data_ptr()  # untied
    with torch.no_grad():
        want, _ = ours(run.idx)
        got = hf(run.idx).logits
    # fp32, the same operations up to summation order (one q|k|v matmul against three; sdpa with a mask against
    # is_causal); both compute the norms and rotary in fp32 from the same tables. The GPT export's bound (1e-4,
    # tests/e2e/test_export.py); a wrong rotary convention, QK-norm after rotary, eps or head moves logits by > 1e-2.
    assert want.abs().max() > 0.5  # logits with content, not a degenerate near-zero comparison
    assert (got - want).abs().max() <= 1e-4
    config = json.loads((run.out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["attention_bias"] is False
    assert config["intermediate_size"] == ours.h[0].mlp.up_proj.weight.shape[0]
    assert config["max_position_embeddings"] == run.cfg.model.block_size


def test_the_run_samples_and_evaluates(run, capsys):
    audits = json.loads((run.dir / ".samples.json").read_text())["audits"]  # the KV-cached decode, in the run
    assert [a["step"] for a in audits] == [STEPS] * len(audits) and all(a["text"] for a in audits)
    capsys.readouterr()
    assert cli_main(["sample", str(run.dir), "--prompt", "The ", "--max-new-tokens", "8", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("The ") and len(out) > len("The ") + 1
    assert cli_main(["eval", str(run.dir), "--tasks", str(TASKS), "--json"]) == 0
    score = json.loads(capsys.readouterr().out)
    assert 0.0 <= score["acc_norm"] <= 1.0 and score["examples"] > 0


def test_export_then_init_from_is_bit_for_bit(run, prepared, tmp_path):
    new = seed_data(prepared, tmp_path / "new")
    result = train(new, *MODERN, "--init-from", str(run.out), "--steps", "0")
    assert result.returncode == 0, result.stderr
    start = np.fromfile(new / "step_000000.bin", dtype="<f4", offset=8).reshape(3, run.n)
    assert start[0].tobytes() == run.weights.tobytes()  # weights, bit for bit
    assert not start[1].any() and not start[2].any()  # m = v = 0
    [marker] = [e for e in ledger(new) if e.get("event") == "start"]
    assert marker["weights_only"] is True and marker["identity"]["model.arch"] == "modern"


def qwen3_file(run, path: Path, edit) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(edit(load_file(str(run.out / export.SAFETENSORS_NAME))), str(path))
    return path


def test_published_style_files_are_read(run, tmp_path):
    """The base model's names (no `model.` prefix), half precision, no norms at all, an old rotary buffer."""
    def published(t):
        t = {k.removeprefix("model."): v.astype(np.float16) for k, v in t.items() if "norm" not in k}
        return {**t, "rotary_emb.inv_freq": np.ones(8, np.float32)}
    flat = init_from.read_weights(qwen3_file(run, tmp_path / "q" / "model.safetensors", published), run.layout, "modern")
    assert flat.tobytes() == run.weights.astype(np.float16).astype(np.float32).tobytes()


@pytest.mark.parametrize("case", ["trained norm", "missing", "unexpected", "misshapen"])
def test_bad_weights_are_refused_in_one_line(run, tmp_path, case):
    C = run.cfg.model.n_embd
    if case == "trained norm":
        edit = lambda t: {**t, "model.layers.1.self_attn.k_norm.weight": np.full(32, 1.5, np.float32)}  # noqa: E731
        words = "model.layers.1.self_attn.k_norm.weight is not all ones"
    elif case == "missing":
        edit = lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"}  # noqa: E731
        words = "missing tensor model.layers.1.mlp.up_proj.weight"
    elif case == "unexpected":
        edit = lambda t: {**t, "model.layers.2.self_attn.q_proj.weight": np.zeros((C, C), np.float32)}  # noqa: E731
        words = "unexpected tensor model.layers.2.self_attn.q_proj.weight"
    else:
        edit = lambda t: {**t, "model.layers.0.self_attn.o_proj.weight": np.zeros((C, 2 * C), np.float32)}  # noqa: E731
        words = f"model.layers.0.self_attn.o_proj.weight has shape ({C}, {2 * C})"
    path = qwen3_file(run, tmp_path / "w" / "model.safetensors", edit)
    with pytest.raises(ckpt.CheckpointError) as e:
        init_from.read_weights(path, run.layout, "modern")
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_config_json_of_another_model_is_refused_before_the_run_directory_exists(run, prepared, tmp_path):
    """The export's config.json says what its weights are: a gpt2 run told to start from a Qwen3 export is told
    which model.arch reads it, and another shape or rotary base is named by its keys, before any data is prepared
    (it used to fail after the tokenizer and the token files were written, naming a missing tensor)."""
    from dataclasses import replace
    init_from.check_config(run.out, run.cfg.model)  # its own model
    cases = [(replace(run.cfg.model, arch="gpt2"), "a qwen3 model, which model.arch = 'modern' reads; this run's "
                                                   "model.arch is 'gpt2' (--set model.arch='modern'"),
             (replace(run.cfg.model, rope_base=500000.0), "rope_theta 10000.0 (this run's: 500000.0)"),
             (replace(run.cfg.model, n_layer=3), "num_hidden_layers 2 (this run's: 3)")]
    for model, words in cases:
        with pytest.raises(ckpt.CheckpointError) as e:
            init_from.check_config(run.out / export.SAFETENSORS_NAME, model)
        assert str(run.out / "config.json") in str(e.value) and words in str(e.value), str(e.value)
    fresh = tmp_path / "fresh"
    result = train(fresh, "--init-from", str(run.out), "--steps", "1")  # the tiny preset's gpt2
    assert result.returncode == 1 and "this run's model.arch is 'gpt2'" in result.stderr.strip().splitlines()[-1]
    assert not fresh.exists()


def test_a_gpt2_run_refuses_a_qwen3_directory_naming_a_tensor(run):
    gpt2 = arch.layout_for(run_config(run.dir).model.__class__(**{**vars(run.cfg.model), "arch": "gpt2"}))
    with pytest.raises(ckpt.CheckpointError, match="missing tensor transformer.wte.weight"):
        init_from.read_weights(run.out, gpt2)


# --- the model extras' export (andrea/model/hf_modeling.py) --------------------------------------------------------
EXTRAS = ("--set", "model.logit_softcap=15.0", "--set", "model.embed_norm=true", "--set", "model.qk_scale=1.2",
          "--set", 'model.mlp="relu2"', "--set", "model.rope_base=100000.0")


@pytest.fixture(scope="module")
def extras_run(prepared, tmp_path_factory):
    """A short modern run with every extra on, exported: andrea's own modeling file beside Qwen3's names."""
    root = tmp_path_factory.mktemp("export_extras")
    run_dir = seed_data(prepared, root / "run")
    result = train(run_dir, *MODERN, *EXTRAS, "--steps", "6", "--set", "train.warmup_steps=1", "--set", "train.lr=0.03")
    assert result.returncode == 0, result.stderr
    out = root / "hf"
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
    cfg = run_config(run_dir)
    layout = arch.layout_for(cfg.model)
    _, payload = ckpt.read_payload(run_dir / names.checkpoint_name(6), n_params(layout))
    tokens = np.fromfile(next((run_dir / "data").glob("*.val.u16")), dtype="<u2").astype(np.int64)
    T = cfg.model.block_size
    idx = torch.from_numpy(np.stack([tokens[:T], tokens[T:2 * T]]))
    return SimpleNamespace(dir=run_dir, out=out, cfg=cfg, layout=layout, n=n_params(layout),
                           weights=payload[:n_params(layout)].copy(), idx=idx)


def test_an_export_with_extras_loads_with_its_modeling_file_and_gives_andreas_logits(extras_run):
    from transformers import AutoModelForCausalLM
    run = extras_run
    config = json.loads((run.out / "config.json").read_text())
    assert config["model_type"] == "andrea_modern" and (run.out / "modeling_andrea.py").is_file()
    assert (config["logit_softcap"], config["embed_norm"], config["mlp"]) == (15.0, True, "relu2")
    with pytest.raises(ValueError):  # without trust_remote_code: refused, never a stock Qwen3 with other logits
        AutoModelForCausalLM.from_pretrained(run.out, trust_remote_code=False)
    hf, info = AutoModelForCausalLM.from_pretrained(run.out, trust_remote_code=True, output_loading_info=True)
    assert type(hf).__name__ == "AndreaModernForCausalLM"
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set()), info
    hf.eval()
    assert not hasattr(hf.model.layers[0].mlp, "gate_proj")
    with torch.no_grad():
        want, _ = andrea_model(run)(run.idx)
        got = hf(run.idx).logits
    assert want.abs().max() > 0.5
    assert (got - want).abs().max() <= 1e-4  # the GPT export's bound (tests/e2e/test_export.py)


def test_an_export_with_extras_comes_back_bit_for_bit_and_only_into_a_run_with_them(extras_run, prepared, tmp_path):
    run = extras_run
    new = seed_data(prepared, tmp_path / "new")
    result = train(new, *MODERN, *EXTRAS, "--init-from", str(run.out), "--steps", "0")
    assert result.returncode == 0, result.stderr
    start = np.fromfile(new / "step_000000.bin", dtype="<f4", offset=8).reshape(3, run.n)
    assert start[0].tobytes() == run.weights.tobytes()
    from dataclasses import replace
    with pytest.raises(ckpt.CheckpointError, match="a andrea_modern model, and this run's model is qwen3"):
        init_from.check_config(run.out, replace(run.cfg.model, logit_softcap=0.0, embed_norm=False, mlp="swiglu"))
    with pytest.raises(ckpt.CheckpointError, match="logit_softcap 15.0 \\(this run's: 30.0\\)"):
        init_from.check_config(run.out, replace(run.cfg.model, logit_softcap=30.0))
    with pytest.raises(ckpt.CheckpointError, match="_norm.weight is not all 1.5 \\(this run's model.qk_scale\\)"):
        init_from.read_weights(run.out, run.layout, "modern", 1.5)


def test_rope_base_and_qk_scale_keep_the_stock_qwen3(run, tmp_path):
    """Qwen3 expresses rope_theta and, as its q_norm/k_norm weights, the q/k scale: the stock class computes a
    model with both, and the weights come back bit for bit."""
    from dataclasses import replace
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM
    cfg = replace(run.cfg.model, qk_scale=1.2, rope_base=100000.0)
    assert export.hf_config(cfg, None)["model_type"] == "qwen3"
    # weights far from a 20-step run's (every attention sharp), so the scale and the base move the logits
    weights = (0.3 * torch.randn(run.n, generator=torch.Generator().manual_seed(5))).numpy()
    out = tmp_path / "q"
    out.mkdir()
    save_file(export.hf_state(run.layout, weights, cfg), str(out / export.SAFETENSORS_NAME), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(export.hf_config(cfg, None)))
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(hf) is Qwen3ForCausalLM
    model, plain = arch.build(cfg).eval(), arch.build(run.cfg.model).eval()
    for m in (model, plain):
        params = dict(m.named_parameters())
        for s in run.layout:
            params[s.name].data.copy_(torch.from_numpy(weights[s.offset:s.offset + s.numel]).view(s.shape))
    with torch.no_grad():
        want = model(run.idx)[0]
        got = hf(run.idx).logits
        assert (want - plain(run.idx)[0]).abs().max() > 1e-2  # the scale and the base matter beyond the bound
    assert (got - want).abs().max() <= 1e-4
    assert init_from.read_weights(out, run.layout, "modern", 1.2).tobytes() == weights.tobytes()


# --- nanochat's parts with parameters (model.value_embeds, resid_lambdas, smear, backout) ----------------------------
PARTS = ("--set", "model.value_embeds=true", "--set", "model.resid_lambdas=true", "--set", "model.smear=true",
         "--set", "model.backout=true", "--set", "train.optimizer=\"normuon\"")


@pytest.fixture(scope="module")
def parts_run(prepared, tmp_path_factory):
    """A short modern run with the four parts on, under NorMuon, exported by the command line."""
    root = tmp_path_factory.mktemp("export_parts")
    run_dir = seed_data(prepared, root / "run")
    result = train(run_dir, *MODERN, *PARTS, "--steps", "6", "--set", "train.warmup_steps=1")
    assert result.returncode == 0, result.stderr
    out = root / "hf"
    assert cli_main(["export", str(run_dir), "--out", str(out)]) == 0
    cfg = run_config(run_dir)
    layout = arch.layout_for(cfg.model)
    _, payload = ckpt.read_payload(run_dir / names.checkpoint_name(6), n_params(layout))
    tokens = np.fromfile(next((run_dir / "data").glob("*.val.u16")), dtype="<u2").astype(np.int64)
    T = cfg.model.block_size
    idx = torch.from_numpy(np.stack([tokens[:T], tokens[T:2 * T]]))
    return SimpleNamespace(dir=run_dir, out=out, cfg=cfg, layout=layout, n=n_params(layout),
                           weights=payload[:n_params(layout)].copy(), idx=idx)


def test_an_export_with_the_parts_loads_every_tensor_and_gives_andreas_logits(parts_run, tmp_path):
    """The run's own export loads with its modeling file, every tensor placed; and on sharp weights (every part far
    from its start, where each moves the logits well beyond the bound) the logits match andrea's, as does a
    cached greedy generation."""
    from transformers import AutoModelForCausalLM
    run = parts_run
    config = json.loads((run.out / "config.json").read_text())
    assert config["model_type"] == "andrea_modern"
    assert [config[k] for k in ("value_embeds", "resid_lambdas", "smear", "backout")] == [True] * 4
    hf, info = AutoModelForCausalLM.from_pretrained(run.out, trust_remote_code=True, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set()), info
    with torch.no_grad():
        assert (hf.eval()(run.idx).logits - andrea_model(run)(run.idx)[0]).abs().max() <= 1e-4
    sharp = SimpleNamespace(**{**vars(run), "weights": (0.3 * torch.randn(
        run.n, generator=torch.Generator().manual_seed(5))).numpy()})
    out = tmp_path / "sharp"
    out.mkdir()
    save_file(export.hf_state(run.layout, sharp.weights, run.cfg.model), str(out / export.SAFETENSORS_NAME),
              metadata={"format": "pt"})
    for name in ("config.json", "modeling_andrea.py"):
        (out / name).write_bytes((run.out / name).read_bytes())
    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    model = andrea_model(sharp)
    plain_cfg = run.cfg.model.__class__(**{**vars(run.cfg.model), "value_embeds": False, "resid_lambdas": False,
                                           "smear": False, "backout": False})
    with torch.no_grad():
        want, got = model(run.idx)[0], hf(run.idx).logits
        assert want.abs().max() > 1.0
        assert (got - want).abs().max() <= 1e-4
        for part in ("value_embeds", "resid_lambdas", "smear", "backout"):  # each moves the logits past the bound
            one = arch.build(run.cfg.model.__class__(**{**vars(plain_cfg), part: True})).eval()
            params = dict(model.named_parameters())
            for name, p in one.named_parameters():
                p.data.copy_(params[name].data)
            assert (one(run.idx)[0] - want).abs().max() > 1e-2, part
        prompt = run.idx[:1, :8]
        hf_tokens = hf.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=True)[0, 8:].tolist()
        # a batch of unequal prompts, left-padded as transformers pads for generation: the short row's first token
        # has no predecessor to smear with (its padding is none), as in andrea's own batched decode
        short = run.idx[1, :5]
        pad = torch.full((3,), int(run.idx[0, 0]))  # a token of the vocabulary, masked out
        batch = torch.stack([run.idx[0, :8], torch.cat([pad, short])])
        mask = torch.tensor([[1] * 8, [0] * 3 + [1] * 5])
        hf_batch = hf.generate(batch, attention_mask=mask, max_new_tokens=5, do_sample=False, use_cache=True,
                               pad_token_id=int(pad[0]))[:, 8:].tolist()
    from andrea.model import generate as generation
    pick = lambda logits: logits.argmax(-1).tolist()  # noqa: E731
    ours = generation.decode(model, prompt.tolist(), 5, pick)[0]
    assert hf_tokens == ours
    assert hf_batch == generation.decode(model, [run.idx[0, :8].tolist(), short.tolist()], 5, pick)


def test_an_export_with_the_parts_comes_back_bit_for_bit(parts_run, prepared, tmp_path):
    run = parts_run
    new = seed_data(prepared, tmp_path / "new")
    result = train(new, *MODERN, *PARTS, "--init-from", str(run.out), "--steps", "0")
    assert result.returncode == 0, result.stderr
    start = np.fromfile(new / "step_000000.bin", dtype="<f4", offset=8).reshape(3, run.n)
    assert start[0].tobytes() == run.weights.tobytes()
    from dataclasses import replace
    with pytest.raises(ckpt.CheckpointError, match="smear True \\(this run's: False\\)"):
        init_from.check_config(run.out, replace(run.cfg.model, smear=False))
