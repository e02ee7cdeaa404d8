"""What `train --init-from` reads: exported or published weights, the starting point of a new run at step 0.

It reads model.safetensors (HF names, with or without the `transformer.` prefix), pytorch_model.bin
(torch.load(weights_only=True)), model.npz (andrea names), or a directory holding one of them; any float dtype
is widened to float32 exactly. Every tensor of the run's layout must be present with its shape, and no other
(GPT-2's non-parameter `h.i.attn.bias` / `masked_bias` mask buffers are ignored); an absent lm_head.weight is
GPT-2's tied head (published GPT-2 files store none) and starts as a copy of wte, unless the config.json beside
the file says tie_word_embeddings = false. The run then starts at step 0 with m = v = 0.

A config.json beside the weights (an export's, a published model's) is checked first, before the run directory is
touched (`check_config`): a model of another kind (a Qwen3 export into a gpt2 run), another shape or another
rotary base is refused in one line naming it, without reading a tensor. Names and shapes are export.py's (GPT-2's)
and andrea/model/qwen3.py's (a modern run's). Reads the weights file and the config.json and tokenizer.json beside
it; writes nothing.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import numpy as np

from andrea.config.schema import ModelConfig
from andrea.model import hf_modeling, qwen3
from andrea.model.export import (HF_PREFIX, IGNORED, NPZ_NAME, SAFETENSORS_NAME, TORCH_NAME, ExportError, hf_config,
                                 hf_name, is_conv1d)
from andrea.model.gpt import ParamSpec, n_params
from andrea.rundir import checkpoint as ckpt, names

log = logging.getLogger("andrea.model.init_from")

KINDS = {"gpt2": "gpt2", "qwen3": "modern", hf_modeling.MODEL_TYPE: "modern"}  # model_type -> the model.arch
# The config.json keys that fix what the tensors are, beyond their names and shapes: what the config says of the
# shape (one line for all of it) and, for Qwen3, the rotary base, which no tensor shows.
SHAPE_KEYS = {"gpt2": ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size"),
              "qwen3": ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size", "head_dim",
                        "intermediate_size", "vocab_size", "rope_theta")}
SHAPE_KEYS[hf_modeling.MODEL_TYPE] = SHAPE_KEYS["qwen3"] + hf_modeling.EXTRA_KEYS


def check_config(path: Path, cfg: ModelConfig) -> None:
    """Refuse (ExportError, one line naming config.json) weights whose config.json describes another model than
    `cfg`: another kind, shape or rotary base. No config.json, or one of a kind andrea does not name, says nothing:
    the tensors decide as they are read."""
    config = (path if path.is_dir() else path.parent) / "config.json"
    try:
        theirs = json.loads(config.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as e:
        raise ExportError(f"{config}: not readable as JSON ({e})") from None
    kind = theirs.get("model_type") if isinstance(theirs, dict) else None
    if kind not in KINDS:
        return
    if KINDS[kind] != cfg.arch:
        raise ExportError(f"{config}: a {kind} model, which model.arch = {KINDS[kind]!r} reads; this run's model.arch "
                          f"is {cfg.arch!r} (--set model.arch={KINDS[kind]!r} and the model's shape)")
    if "rope_theta" not in theirs and isinstance(theirs.get("rope_parameters"), dict):  # transformers 5
        theirs = {**theirs, "rope_theta": theirs["rope_parameters"].get("rope_theta")}
    ours = hf_config(replace(cfg, bias=True), None)  # GPT-2's has biases: a bias-free run fails on the tensors
    if ours["model_type"] != kind:  # a stock Qwen3 into a run with extras, or the other way round
        extras = ", ".join(f"{k} {ours.get(k, theirs.get(k))!r}" for k in hf_modeling.EXTRA_KEYS)
        raise ExportError(f"{config}: a {kind} model, and this run's model is {ours['model_type']} (model.{extras} "
                          f"on one side only)")
    differ = [f"{k} {theirs[k]!r} (this run's: {ours[k]!r})" for k in SHAPE_KEYS[kind]
              if theirs.get(k) is not None and theirs[k] != ours[k]]
    if differ:
        raise ExportError(f"{config}: not this run's model: {'; '.join(differ)}")


def is_weights(path: Path | None) -> bool:
    """True when `--init-from` names exported or published weights rather than a step_NNNNNN.bin checkpoint."""
    if path is None or names.step_of(path) is not None:
        return False
    return not path.is_file() or path.suffix in (".safetensors", ".npz") or path.name == TORCH_NAME


def weights_file(path: Path) -> Path:
    if not path.is_dir():
        if not path.exists():
            raise ExportError(f"{path}: no such file or directory")
        return path
    for name in (SAFETENSORS_NAME, TORCH_NAME, NPZ_NAME):
        if (path / name).is_file():
            return path / name
    if (path / f"{SAFETENSORS_NAME}.index.json").exists():
        raise ExportError(f"{path}: sharded safetensors are not supported; merge the shards into {SAFETENSORS_NAME}")
    raise ExportError(f"{path}: no {SAFETENSORS_NAME}, {TORCH_NAME} or {NPZ_NAME} in this directory")


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a weights file, by the name it has there, widened to float32 (no renames, no transposes)."""
    import torch
    try:
        if path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                raw = {k: torch.from_numpy(z[k]) for k in z.files}
        elif path.suffix == ".safetensors":
            from safetensors.torch import load_file
            raw = load_file(str(path))
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(raw, dict) or not all(isinstance(v, torch.Tensor) for v in raw.values()):
                raise ExportError(f"{path}: not a state dict of tensors")
    except ExportError:
        raise
    except Exception as e:  # safetensors, numpy and torch each raise their own types on a bad file
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ExportError(f"{path}: not a readable {path.suffix or 'weights'} file: {first}") from None
    out = {}
    for k, v in raw.items():
        if not v.is_floating_point():
            raise ExportError(f"{path}: {k} has dtype {v.dtype}, not a float tensor")
        out[k] = v.float().numpy()
    return out


def _tied_allowed(path: Path) -> bool:
    config = path.parent / "config.json"
    try:
        return json.loads(config.read_text()).get("tie_word_embeddings", True) is not False
    except (OSError, ValueError, AttributeError):
        return True  # no (readable) config: GPT-2's default, a tied head


def read_weights(path: Path, layout: list[ParamSpec], arch: str = "gpt2", qk_scale: float = 1.0) -> np.ndarray:
    """The flat float32 weights (n,) in andrea's order from a weights file or directory (see the docstring), for
    the model `arch` (model.arch) whose layout this is: GPT-2's names, or Qwen3's (andrea/model/qwen3.py), whose
    q_norm and k_norm weights must be `qk_scale` (model.qk_scale) and every other norm weight one."""
    file = weights_file(path)
    tensors = read_tensors(file)
    andrea_names = file.suffix == ".npz"
    modern = arch == "modern" and not andrea_names
    if modern:  # Qwen3's names, with or without the base-model prefix; its norms must be ones
        tensors = {qwen3.andrea_name(k): v for k, v in tensors.items()}
        _check_norms(file, {k: tensors.pop(k) for k in list(tensors) if qwen3.is_norm(k)}, qk_scale)
    elif not andrea_names:  # HF names, with or without the base-model prefix
        tensors = {k.removeprefix(HF_PREFIX): v for k, v in tensors.items()}

    def shown(name: str) -> str:
        return name if andrea_names else qwen3.hf_name(name) if modern else hf_name(name)

    flat = np.empty(n_params(layout), dtype=np.float32)
    for spec in layout:
        a = tensors.pop(spec.name, None)
        if a is None and spec.name == "lm_head.weight" and _tied_allowed(file):
            log.info("%s: no lm_head.weight: a tied head, so the head starts as a copy of the token embedding", file)
            a = flat[layout[0].offset:layout[0].offset + layout[0].numel]
        elif a is None:
            raise ExportError(f"{file}: missing tensor {shown(spec.name)} {_shape(spec, andrea_names)} "
                              f"of this run's model")
        elif tuple(a.shape) != _expected(spec, andrea_names):
            raise ExportError(f"{file}: {shown(spec.name)} has shape {_fmt(a.shape)}, this run's model needs "
                              f"{_shape(spec, andrea_names)}")
        elif not andrea_names and is_conv1d(spec.name):
            a = a.T
        if not np.isfinite(a).all():
            raise ExportError(f"{file}: {shown(spec.name)} has non-finite values")
        flat[spec.offset:spec.offset + spec.numel] = a.reshape(-1)
    unexpected = [k for k in tensors if not (qwen3.IGNORED if modern else IGNORED).match(k)]
    if unexpected:
        raise ExportError(f"{file}: unexpected tensor {shown(unexpected[0])} (not in this run's model; "
                          f"{len(unexpected)} such)")
    return flat


def _check_norms(file: Path, norms: dict[str, np.ndarray], qk_scale: float) -> None:
    """Qwen3's norm weights as andrea's parameter-free norms read them: all ones (q_norm and k_norm: the run's
    model.qk_scale, as float32), or refused in one line."""
    for name, a in norms.items():
        want = qwen3.norm_value(name, replace(ModelConfig(arch="modern"), qk_scale=qk_scale))
        if not (a == np.float32(want)).all():
            value = "ones" if want == 1.0 else f"{want:g} (this run's model.qk_scale)"
            raise ExportError(f"{file}: {qwen3.hf_name(name)} is not all {value}: andrea's modern model has "
                              f"parameter-free norms (q and k scaled by model.qk_scale, other weights fixed at 1) "
                              f"and cannot hold trained norm weights")


def _fmt(shape) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


def _expected(spec: ParamSpec, andrea_names: bool) -> tuple[int, ...]:
    """The shape a tensor has in the file: andrea's, or GPT-2's Conv1D (in, out) for an HF-named matrix."""
    return spec.shape[::-1] if not andrea_names and is_conv1d(spec.name) else spec.shape


def _shape(spec: ParamSpec, andrea_names: bool) -> str:
    return _fmt(_expected(spec, andrea_names))


def init_payload(path: Path, layout: list[ParamSpec], run_dir: Path, arch: str = "gpt2", qk_scale: float = 1.0
                 ) -> np.ndarray:
    """[w | m = 0 | v = 0] (3n,) for a run that starts at step 0 from the weights at `path`."""
    existing = ckpt.list_checkpoints(run_dir)
    if existing:
        raise ExportError(f"{run_dir}: holds checkpoints ({existing[-1][1].name}); --init-from {path.name} starts a "
                          f"new run at step 0: drop --init-from to resume, or use an empty run directory")
    n = n_params(layout)
    payload = np.zeros(3 * n, dtype=np.float32)
    payload[:n] = read_weights(path, layout, arch, qk_scale)
    _warn_tokenizer(path, run_dir)
    return payload


def _warn_tokenizer(path: Path, run_dir: Path) -> None:
    theirs = (path if path.is_dir() else path.parent) / "tokenizer.json"
    ours = run_dir / names.TOKENIZER_NAME
    if not (theirs.exists() and ours.exists()) or theirs.resolve() == ours.resolve():
        return
    try:
        same = json.loads(theirs.read_text()).get("model") == json.loads(ours.read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        return
    if not same:
        log.warning("%s differs from the run's %s: the weights were trained on other token ids (set "
                    "data.tokenizer to it in a fresh run directory to train with their tokenizer)", theirs, ours)


def load_init_weights(init_from: Path | None, trainer, run_dir: Path) -> dict | None:
    """If `init_from` names weights (not a checkpoint), load [w | 0 | 0] into the trainer; return the start
    marker's fields ({"from": path}), else None (a checkpoint or nothing: the runtime's resume rules apply)."""
    if not is_weights(init_from):
        return None
    import torch
    model = trainer.cfg.model
    trainer.load(torch.from_numpy(init_payload(init_from, trainer.layout, run_dir, model.arch, model.qk_scale)))
    return {"from": str(init_from.resolve()), "weights_only": True}
