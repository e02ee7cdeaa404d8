"""Models that leave andrea and come back (andrea/model/export.py, andrea/model/init_from.py): `andrea export` to a
Hugging Face GPT-2 directory or npz, loaded by `transformers` with andrea's logits and tokens, and `train
--init-from` of such weights, bit for bit.

One short tiny-preset run is trained and exported once per module; the rest reads that export in-process.
"""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from andrea.model import export, init_from
from andrea.cli import main as cli_main
from andrea.config.load import run_config
from andrea.data.store import EOT, TextCodec
from andrea.model.gpt import GPT, layout_for, n_params
from andrea.rundir import checkpoint as ckpt, names
from tests.runs import andrea, ledger, seed_data, train

transformers = pytest.importorskip("transformers", reason="transformers is a test extra: pip install -e '.[test]'")

STEPS = 10


@pytest.fixture(scope="module")
def run(prepared, tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    run_dir = seed_data(prepared, root / "run")
    result = train(run_dir, "--steps", str(STEPS))
    assert result.returncode == 0, result.stderr
    out = root / "hf"
    result = andrea("export", str(run_dir), "--out", str(out))
    assert result.returncode == 0, result.stderr
    cfg = run_config(run_dir)
    layout = layout_for(cfg.model)
    n = n_params(layout)
    step, payload = ckpt.read_payload(run_dir / names.checkpoint_name(STEPS), n)
    tokens = np.fromfile(next((run_dir / "data").glob("*.val.u16")), dtype="<u2").astype(np.int64)
    T = cfg.model.block_size
    idx = torch.from_numpy(np.stack([tokens[:T], tokens[T:2 * T]]))  # (2, T) real text
    return SimpleNamespace(dir=run_dir, out=out, cfg=cfg, layout=layout, n=n, weights=payload[:n].copy(), idx=idx)


def andrea_model(run, dtype: torch.dtype) -> GPT:
    """andrea's GPT (torch math, as `--kernels torch` trains it) holding the run's weights in `dtype`."""
    with torch.device("meta"):
        model = GPT(run.cfg.model)
    model.to_empty(device="cpu").to(dtype).eval()
    params = dict(model.named_parameters())
    for s in run.layout:
        params[s.name].data.copy_(torch.from_numpy(run.weights[s.offset:s.offset + s.numel]).view(s.shape))
    return model


def test_transformers_loads_every_tensor_untied_and_gives_andreas_logits(run):
    from transformers import GPT2LMHeadModel
    hf, info = GPT2LMHeadModel.from_pretrained(run.out, output_loading_info=True)
    assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (set(), set(), set()), info
    hf.eval()
    ours = andrea_model(run, torch.float32)
    # The head is andrea's own lm_head, not a tie to wte (the two differ: initialised and trained apart).
    assert not torch.equal(ours.lm_head.weight, ours.wte.weight)
    assert torch.equal(hf.lm_head.weight, ours.lm_head.weight)
    assert hf.lm_head.weight.data_ptr() != hf.transformer.wte.weight.data_ptr()
    with torch.no_grad():
        want, _ = ours(run.idx)
        got = hf(run.idx).logits
        # fp32: the same operations up to summation order (Conv1D's addmm(x, W) against Linear's x @ W^T; sdpa
        # with a mask against is_causal). Each of the 6·n_layer + 1 matmuls, of depth <= 4C = 256, adds about
        # sqrt(256)·6e-8 ≈ 1e-6 relative error: < 1e-5 on logits of magnitude < 10. 1e-4 leaves 10x headroom; a
        # wrong transpose, q/k/v order, GELU, eps or tied head moves logits by > 1e-2.
        assert want.abs().max() > 0.5  # logits with content, not a degenerate near-zero comparison
        assert (got - want).abs().max() <= 1e-4
        # fp64: rounding falls to ~1e-16 relative, so agreement to 1e-9 pins the two as the same math.
        want64, _ = andrea_model(run, torch.float64)(run.idx)
        got64 = hf.double()(run.idx).logits
        assert (got64 - want64).abs().max() <= 1e-9
    config = json.loads((run.out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False and config["n_positions"] == run.cfg.model.block_size
    assert config["activation_function"] == "gelu_pytorch_tanh" and config["layer_norm_epsilon"] == 1e-5


def test_auto_tokenizer_encodes_like_the_runs_tokenizer(run):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(run.out)
    codec = TextCodec.load(run.dir / "tokenizer.json")
    assert (run.out / "tokenizer.json").read_bytes() == (run.dir / "tokenizer.json").read_bytes()
    for text in ["Hello, world! It's 2024.", "naïve café — 日本語 🙂 ∑x²",
                 "def f(x):\n    return {'k': x ** 2}  # sq\n\tpass", f"one{EOT}two", "  leading spaces"]:
        ids = codec.encode(text)
        assert tok(text)["input_ids"] == ids, text
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == codec.decode(ids)  # andrea's decode drops specials
    assert tok.eos_token == tok.bos_token == EOT and tok.eos_token_id == codec.eot
    assert json.loads((run.out / "config.json").read_text())["eos_token_id"] == codec.eot


def test_export_then_init_from_is_bit_for_bit(run, prepared, tmp_path):
    new = seed_data(prepared, tmp_path / "new")
    source = run.out / export.SAFETENSORS_NAME
    result = train(new, "--init-from", str(source), "--steps", "0")
    assert result.returncode == 0, result.stderr
    start = np.fromfile(new / "step_000000.bin", dtype="<f4", offset=8).reshape(3, run.n)
    assert start[0].tobytes() == run.weights.tobytes()  # weights, bit for bit
    assert not start[1].any() and not start[2].any()  # m = v = 0
    [marker] = [e for e in ledger(new) if e.get("event") == "start"]
    assert marker["step"] == 0 and marker["from"] == str(source.resolve()) and marker["weights_only"] is True
    # The directory form reads the same file; a run that already holds checkpoints refuses to be overwritten.
    assert init_from.read_weights(run.out, run.layout).tobytes() == run.weights.tobytes()
    with pytest.raises(ckpt.CheckpointError, match="holds checkpoints"):
        init_from.init_payload(run.out, run.layout, new)


def test_init_from_a_misshapen_model_is_one_line_naming_the_config_key_or_the_tensor(run, prepared, tmp_path):
    """With its config.json the shape is refused by its keys, before anything is written; a bare weights file by
    the first tensor that does not fit."""
    new = seed_data(prepared, tmp_path / "new")
    before = sorted(p.name for p in new.rglob("*"))
    result = train(new, "--init-from", str(run.out), "--set", "model.block_size=32", "--steps", "1")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"andrea: error: {run.out / 'config.json'}: not this run's model: n_positions 64 (this run's: 32)"]
    assert sorted(p.name for p in new.rglob("*")) == before
    bare = tmp_path / "bare" / export.SAFETENSORS_NAME
    bare.parent.mkdir()
    shutil.copy(run.out / export.SAFETENSORS_NAME, bare)
    result = train(new, "--init-from", str(bare), "--set", "model.block_size=32", "--steps", "1")
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"andrea: error: {bare}: transformer.wpe.weight has shape (64, 64), this run's model needs (32, 64)"]
    assert not ckpt.list_checkpoints(new)


def test_npz_export_uses_andreas_names_and_round_trips(run, tmp_path):
    out = tmp_path / "np"
    assert cli_main(["export", str(run.dir), "--out", str(out), "--format", "npz", "--step", str(STEPS)]) == 0
    with np.load(out / export.NPZ_NAME) as z:
        assert z.files == [s.name for s in run.layout]
        for s in run.layout:
            assert z[s.name].dtype == np.float32 and z[s.name].shape == s.shape
            assert z[s.name].tobytes() == run.weights[s.offset:s.offset + s.numel].tobytes()
    assert init_from.read_weights(out / export.NPZ_NAME, run.layout).tobytes() == run.weights.tobytes()
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()


# --- import: what is accepted and what is refused -----------------------------------------------------------
def hf_file(run, path: Path, edit=lambda t: t, prefix: bool = True) -> Path:
    tensors = load_file(str(run.out / export.SAFETENSORS_NAME))
    if not prefix:
        tensors = {k.removeprefix("transformer."): v for k, v in tensors.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(edit(tensors), str(path))
    return path


def test_published_gpt2_style_files_are_read(run, tmp_path):
    def published(t):  # no prefix, causal-mask buffers, no lm_head (tied), half precision
        t = {k: v.astype(np.float16) for k, v in t.items() if k != "lm_head.weight"}
        return {**t, "h.0.attn.bias": np.ones((1, 1, 64, 64), np.float16), "h.1.attn.masked_bias": np.ones(1)}
    flat = init_from.read_weights(hf_file(run, tmp_path / "gpt2" / "model.safetensors", published, prefix=False),
                               run.layout)
    want = {s.name: run.weights[s.offset:s.offset + s.numel].astype(np.float16).astype(np.float32)
            for s in run.layout}
    got = {s.name: flat[s.offset:s.offset + s.numel] for s in run.layout}
    assert all(np.array_equal(got[k], want[k]) for k in want if k != "lm_head.weight")
    assert np.array_equal(got["lm_head.weight"], want["wte.weight"])  # the tied head, untied from here on
    # pytorch_model.bin (torch.load(weights_only=True)) in a transformers directory
    d = tmp_path / "bin"
    d.mkdir()
    torch.save({k: torch.from_numpy(v) for k, v in load_file(str(run.out / export.SAFETENSORS_NAME)).items()},
               d / export.TORCH_NAME)
    assert init_from.read_weights(d, run.layout).tobytes() == run.weights.tobytes()


@pytest.mark.parametrize("case", ["missing", "unexpected", "untied head missing", "integer", "not safetensors",
                                  "empty directory"])
def test_bad_weights_are_refused_in_one_line(run, tmp_path, case):
    path = tmp_path / "w" / "model.safetensors"
    if case == "missing":
        hf_file(run, path, lambda t: {k: v for k, v in t.items() if k != "transformer.h.1.mlp.c_fc.bias"})
        words = "missing tensor transformer.h.1.mlp.c_fc.bias (256)"
    elif case == "unexpected":
        hf_file(run, path, lambda t: {**t, "transformer.h.2.ln_1.weight": np.ones(64, np.float32)})
        words = "unexpected tensor transformer.h.2.ln_1.weight"
    elif case == "untied head missing":
        hf_file(run, path, lambda t: {k: v for k, v in t.items() if k != "lm_head.weight"})
        shutil.copy(run.out / "config.json", path.parent / "config.json")  # tie_word_embeddings = false
        words = "missing tensor lm_head.weight (512, 64)"
    elif case == "integer":
        hf_file(run, path, lambda t: {**t, "transformer.wte.weight": np.zeros((512, 64), np.int32)})
        words = "transformer.wte.weight has dtype torch.int32"
    elif case == "not safetensors":
        path.parent.mkdir()
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
        words = "not a readable .safetensors file"
    else:
        path = path.parent
        path.mkdir()
        words = "no model.safetensors, pytorch_model.bin or model.npz"
    with pytest.raises(ckpt.CheckpointError) as e:
        init_from.read_weights(path, run.layout)
    assert words in str(e.value) and "\n" not in str(e.value)


# --- export: every bad input is one line and writes nothing -------------------------------------------------
def _listing(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("case", ["no checkpoint", "invalid checkpoint", "missing step", "invalid step",
                                  "non-empty out", "out is a file", "bias=false", "not a run"])
def test_bad_export_is_one_line_and_writes_nothing(run, tmp_path, capsys, case):
    src = tmp_path / "run"
    shutil.copytree(run.dir, src, ignore=shutil.ignore_patterns("data", "train.lock"))
    out, extra = tmp_path / "out", []
    checkpoint = src / names.checkpoint_name(STEPS)
    if case == "no checkpoint":
        checkpoint.unlink()
        words = "no step_NNNNNN.bin checkpoint to export"
    elif case in ("invalid checkpoint", "invalid step"):
        with open(checkpoint, "r+b") as f:
            f.truncate(1000)
        words = "truncated"
        extra = ["--step", str(STEPS)] if case == "invalid step" else []
    elif case == "missing step":
        extra, words = ["--step", "7"], f"no step_000007.bin (checkpoints: {checkpoint.name})"
    elif case == "non-empty out":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        words = "exists and is not an empty directory"
    elif case == "out is a file":
        out.write_text("mine")
        words = "exists and is not an empty directory"
    elif case == "bias=false":
        toml = src / "run.toml"
        toml.write_text(toml.read_text().replace("bias = true", "bias = false"))
        words = "model.bias=false"
    else:
        (src / "run.toml").unlink()
        words = "not a run directory"
    before = _listing(tmp_path)
    capsys.readouterr()
    assert cli_main(["export", str(src), "--out", str(out), *extra]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("andrea: error: ") and words in err[0], err
    assert _listing(tmp_path) == before  # nothing written, no temporary directory left behind


def test_export_fills_an_existing_empty_directory(run, tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert cli_main(["export", str(run.dir), "--out", str(out)]) == 0
    assert init_from.read_weights(out, run.layout).tobytes() == run.weights.tobytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # no temporary sibling left


def test_weights_trained_on_another_tokenizer_are_loaded_with_a_warning(run, tmp_path, caplog):
    other = tmp_path / "other"
    other.mkdir()
    tok = json.loads((run.dir / "tokenizer.json").read_text())
    tok["model"]["vocab"] = {k: (v + 1) % len(tok["model"]["vocab"]) for k, v in tok["model"]["vocab"].items()}
    (other / "tokenizer.json").write_text(json.dumps(tok))
    payload = init_from.init_payload(run.out, run.layout, other)
    assert payload[:run.n].tobytes() == run.weights.tobytes()
    assert any("differs from the run's" in r.getMessage() for r in caplog.records)
    caplog.clear()
    init_from.init_payload(run.out, run.layout, seed_data(run.dir, tmp_path / "same"))
    assert not any("differs" in r.getMessage() for r in caplog.records)
