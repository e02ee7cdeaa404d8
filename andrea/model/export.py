"""Models that leave andrea and come back: a checkpoint's weights as a Hugging Face GPT-2 directory (or numpy
arrays), and such weights as the starting point of a new run (`train --init-from`). A modern run
(`model.arch = "modern"`) exports as a `Qwen3ForCausalLM` directory instead: its names, config and norm weights
are andrea/model/qwen3.py's; the files, the tokenizer, npz and every refusal are the same as below.

andrea's model is GPT-2 (andrea/model/gpt.py): learned positions, pre-LayerNorm blocks, tanh-approximated GELU,
LayerNorm eps 1e-5, biases everywhere, an untied head. Name mapping, andrea layout name → HF `GPT2LMHeadModel`
state-dict name (the layout names are GPT-2's own, under the `transformer.` prefix):
    wte.weight (V, C)                       transformer.wte.weight (V, C)
    wpe.weight (T, C)                       transformer.wpe.weight (T, C)
    h.i.ln_{1,2}.{weight,bias} (C)          transformer.h.i.ln_{1,2}.{weight,bias} (C)
    h.i.attn.c_attn.weight (3C, C)          transformer.h.i.attn.c_attn.weight (C, 3C)   transposed
    h.i.attn.c_proj.weight (C, C)           transformer.h.i.attn.c_proj.weight (C, C)    transposed
    h.i.mlp.c_fc.weight (4C, C)             transformer.h.i.mlp.c_fc.weight (C, 4C)      transposed
    h.i.mlp.c_proj.weight (C, 4C)           transformer.h.i.mlp.c_proj.weight (4C, C)    transposed
    every bias, ln_f.{weight,bias}          transformer.<same name>, same shape
    lm_head.weight (V, C)                   lm_head.weight (V, C), untied: tie_word_embeddings = false
Linear weights are torch's (out, in); GPT-2's Conv1D keeps (in, out) and computes x @ W + b, hence the four
transposes. c_attn's output splits into q, k, v in that order in both models, heads laid out (n_head, head_dim).

`export` writes into a temporary sibling `.<DIR>.partial-<random>` and renames it onto DIR (absent or empty):
    model.safetensors        HF names and shapes above, float32; metadata format=pt, andrea_step, andrea_run
      or model.npz           (--format npz) andrea's layout names and shapes, float32, no transposes
    config.json              GPT2Config: sizes, activation gelu_pytorch_tanh (torch's tanh GELU, op for op),
                             layer_norm_epsilon, dropouts, tie_word_embeddings = false, bos/eos = end-of-text id
    generation_config.json   bos/eos = end-of-text id
    tokenizer.json           the run's tokenizer, byte for byte
    tokenizer_config.json    PreTrainedTokenizerFast over tokenizer.json; model_max_length = block_size
    special_tokens_map.json  bos = eos = unk = <|endoftext|>
(no tokenizer files for a run whose arms are all pre-tokenized: it has no tokenizer).

Import reads model.safetensors (HF names, with or without the `transformer.` prefix), pytorch_model.bin
(torch.load(weights_only=True)), model.npz (andrea names), or a directory holding one of them; any float dtype
is widened to float32 exactly. Every tensor of the run's layout must be present with its shape, and no other
(GPT-2's non-parameter `h.i.attn.bias` / `masked_bias` mask buffers are ignored); an absent lm_head.weight is
GPT-2's tied head (published GPT-2 files store none) and starts as a copy of wte, unless the config.json beside
the file says tie_word_embeddings = false. The run then starts at step 0 with m = v = 0.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from andrea.config.schema import ModelConfig, RunConfig
from andrea.model import qwen3
from andrea.model.arch import layout_for
from andrea.model.gpt import LayerNorm, ParamSpec, n_params
from andrea.rundir import atomic, checkpoint as ckpt, names

log = logging.getLogger("andrea.model.export")

FORMATS = ("safetensors", "npz")
SAFETENSORS_NAME, NPZ_NAME, TORCH_NAME = "model.safetensors", "model.npz", "pytorch_model.bin"
HF_PREFIX = "transformer."
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
IGNORED = re.compile(r"^h\.\d+\.attn\.(bias|masked_bias)$")  # GPT-2's causal-mask buffers, not parameters
ACTIVATION = "gelu_pytorch_tanh"  # F.gelu(approximate="tanh"), what andrea's MLP calls (gelu_new: same math)


class ExportError(ckpt.CheckpointError):
    """Weights that cannot be exported or imported; the message is one line naming the file and the problem."""


def hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else HF_PREFIX + name


def is_conv1d(name: str) -> bool:
    return name.endswith(CONV1D)


# --- export ------------------------------------------------------------------------------------------------
def hf_tensors(layout: list[ParamSpec], weights: np.ndarray) -> dict[str, np.ndarray]:
    """HF GPT-2 state dict (name → contiguous float32 array) from andrea's flat weights (n,)."""
    out = {}
    for spec in layout:
        a = weights[spec.offset:spec.offset + spec.numel].reshape(spec.shape)
        out[hf_name(spec.name)] = np.ascontiguousarray(a.T if is_conv1d(spec.name) else a, dtype=np.float32)
    return out


def hf_state(layout: list[ParamSpec], weights: np.ndarray, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """The state dict the export's model.safetensors holds: GPT-2's, or Qwen3's with its norms as ones."""
    if cfg.arch != "modern":
        return hf_tensors(layout, weights)
    out = {qwen3.hf_name(s.name): np.ascontiguousarray(weights[s.offset:s.offset + s.numel].reshape(s.shape),
                                                      dtype=np.float32) for s in layout}
    return {**out, **qwen3.norm_tensors(cfg)}


def hf_config(cfg: ModelConfig, eot: int | None) -> dict:
    """config.json: GPT2LMHeadModel's for a gpt2 run (refusing bias = false), Qwen3ForCausalLM's for a modern one."""
    return qwen3.config(cfg, eot) if cfg.arch == "modern" else gpt2_config(cfg, eot)


def andrea_arrays(layout: list[ParamSpec], weights: np.ndarray) -> dict[str, np.ndarray]:
    return {s.name: weights[s.offset:s.offset + s.numel].reshape(s.shape).astype(np.float32) for s in layout}


def gpt2_config(cfg: ModelConfig, eot: int | None) -> dict:
    if not cfg.bias:
        raise ExportError("model.bias=false: GPT-2 has biases in every Linear and LayerNorm and cannot express "
                          "this model; export needs a run with model.bias=true")
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.block_size, "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_inner": 4 * cfg.n_embd,
        "activation_function": ACTIVATION,
        "layer_norm_epsilon": LayerNorm(1, True).eps,
        # andrea drops out after the embeddings and on both residual branches, never inside attention
        "embd_pdrop": cfg.dropout, "resid_pdrop": cfg.dropout, "attn_pdrop": 0.0,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32",
    }


def tokenizer_source(cfg: RunConfig, run_dir: Path) -> Path | None:
    """The run's tokenizer file as store.prepare chose it; None for a run with only pre-tokenized arms."""
    token_arms = {s.name for s in cfg.data.sources if s.kind == "tokens"}
    if all(a in token_arms for a in cfg.data.arm_names()):
        return None
    return Path(cfg.data.tokenizer) if cfg.data.tokenizer != "bpe" else run_dir / names.TOKENIZER_NAME


def tokenizer_files(path: Path, block_size: int) -> tuple[dict[str, bytes], int]:
    """The files AutoTokenizer.from_pretrained needs, and the end-of-text id."""
    from andrea.data.store import EOT, TextCodec
    if not path.exists():
        raise ExportError(f"{path}: the run's tokenizer is missing")
    codec = TextCodec.load(path)
    if codec.eot is None:
        raise ExportError(f"{path}: tokenizer has no {EOT} token")
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
              "add_prefix_space": False, "clean_up_tokenization_spaces": False, **special}
    return {"tokenizer.json": path.read_bytes(), "tokenizer_config.json": _json(config),
            "special_tokens_map.json": _json(special)}, codec.eot


def pick_checkpoint(run_dir: Path, n: int, step: int | None, purpose: str = "export") -> Path:
    """step_S.bin when `step` is given (present; read_payload validates it), else the newest checkpoint that passes
    deep validation, newer invalid ones skipped with a warning. `purpose` words the refusals (`andrea eval` too)."""
    if step is not None:
        path = run_dir / names.checkpoint_name(step)
        if not path.exists():
            have = [p.name for _, p in ckpt.list_checkpoints(run_dir)]
            listing = f"checkpoints: {', '.join(have[-5:])}" if have else "it holds no checkpoints"
            raise ExportError(f"{run_dir}: no {path.name} ({listing})")
        return path
    info, skipped = ckpt.newest_valid(run_dir, n)
    if info is None:
        raise ExportError(f"{skipped[0]} (no valid checkpoint to {purpose})" if skipped
                          else f"{run_dir}: no step_NNNNNN.bin checkpoint to {purpose}")
    for line in skipped:
        log.warning("skipping invalid checkpoint, taking an older one to %s: %s", purpose, line)
    return info.path


def export_run(run_dir: Path, out: Path, step: int | None = None, fmt: str = "safetensors") -> Path:
    """Write the export directory `out` from a run's checkpoint (the newest valid one unless `step`)."""
    from andrea.config.load import run_config
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt}: not one of {', '.join(FORMATS)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: exists and is not an empty directory; export writes a new one")
    cfg = run_config(run_dir)
    config = hf_config(cfg.model, None)  # refuses a gpt2 run's bias=false before reading anything large
    layout = layout_for(cfg.model)
    path = pick_checkpoint(run_dir, n_params(layout), step)
    header_step, payload = ckpt.read_payload(path, n_params(layout))
    weights = payload[:n_params(layout)]
    files: dict[str, bytes | Callable[[Path], None]] = {}
    source = tokenizer_source(cfg, run_dir)
    if source is not None:
        tok, eot = tokenizer_files(source, cfg.model.block_size)
        files.update(tok)
        config = hf_config(cfg.model, eot)
        files["generation_config.json"] = _json({"bos_token_id": eot, "eos_token_id": eot})
    else:
        log.warning("%s: every arm is pre-tokenized, so the run has no tokenizer; exporting the model alone", run_dir)
    files["config.json"] = _json(config)
    if fmt == "safetensors":
        from safetensors.numpy import save_file
        tensors = hf_state(layout, weights, cfg.model)
        meta = {"format": "pt", "andrea_step": str(header_step), "andrea_run": str(run_dir.resolve())}
        files[SAFETENSORS_NAME] = lambda p: save_file(tensors, str(p), metadata=meta)
    else:
        arrays = andrea_arrays(layout, weights)
        files[NPZ_NAME] = lambda p: np.savez(p, **arrays)
    _commit_dir(out, files)
    log.info("exported %s (step %d) to %s", path.name, header_step, out)
    return out


def _json(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def _commit_dir(out: Path, files: dict[str, bytes | Callable[[Path], None]]) -> None:
    """Write every file into a fresh sibling directory, fsync it, then rename it onto `out` (absent or empty)."""
    out = out.absolute()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # not `*.tmp`: a trainer starting in this directory deletes those as its own leftovers
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    except OSError as e:
        raise OSError(f"{out.parent}: cannot create the export directory: {e.strerror}") from None
    try:
        for name, content in files.items():
            if isinstance(content, bytes):
                (tmp / name).write_bytes(content)
            else:
                content(tmp / name)
            os.chmod(tmp / name, 0o644)  # safetensors creates its file 0600
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        atomic.fsync_dir(tmp)
        os.rename(tmp, out)  # replaces an empty directory, fails on anything else
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise OSError(f"{out}: export not written: {e.strerror or e}") from None
        raise
    atomic.fsync_dir(out.parent)


# --- import ------------------------------------------------------------------------------------------------
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


def read_weights(path: Path, layout: list[ParamSpec], arch: str = "gpt2") -> np.ndarray:
    """The flat float32 weights (n,) in andrea's order from a weights file or directory (see the docstring), for
    the model `arch` (model.arch) whose layout this is: GPT-2's names, or Qwen3's (andrea/model/qwen3.py)."""
    file = weights_file(path)
    tensors = read_tensors(file)
    andrea_names = file.suffix == ".npz"
    modern = arch == "modern" and not andrea_names
    if modern:  # Qwen3's names, with or without the base-model prefix; its norms must be ones
        tensors = {qwen3.andrea_name(k): v for k, v in tensors.items()}
        _check_unit_norms(file, {k: tensors.pop(k) for k in list(tensors) if qwen3.is_norm(k)})
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


def _check_unit_norms(file: Path, norms: dict[str, np.ndarray]) -> None:
    """Qwen3's norm weights as andrea's parameter-free norms read them: all ones, or refused in one line."""
    for name, a in norms.items():
        if not (a == 1.0).all():
            raise ExportError(f"{file}: {qwen3.hf_name(name)} is not all ones: andrea's modern model has "
                              f"parameter-free norms (weights fixed at 1) and cannot hold trained norm weights")


def _fmt(shape) -> str:
    return "(" + ", ".join(str(int(d)) for d in shape) + ")"


def _expected(spec: ParamSpec, andrea_names: bool) -> tuple[int, ...]:
    """The shape a tensor has in the file: andrea's, or GPT-2's Conv1D (in, out) for an HF-named matrix."""
    return spec.shape[::-1] if not andrea_names and is_conv1d(spec.name) else spec.shape


def _shape(spec: ParamSpec, andrea_names: bool) -> str:
    return _fmt(_expected(spec, andrea_names))


def init_payload(path: Path, layout: list[ParamSpec], run_dir: Path, arch: str = "gpt2") -> np.ndarray:
    """[w | m = 0 | v = 0] (3n,) for a run that starts at step 0 from the weights at `path`."""
    existing = ckpt.list_checkpoints(run_dir)
    if existing:
        raise ExportError(f"{run_dir}: holds checkpoints ({existing[-1][1].name}); --init-from {path.name} starts a "
                          f"new run at step 0: drop --init-from to resume, or use an empty run directory")
    n = n_params(layout)
    payload = np.zeros(3 * n, dtype=np.float32)
    payload[:n] = read_weights(path, layout, arch)
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
    trainer.load(torch.from_numpy(init_payload(init_from, trainer.layout, run_dir, trainer.cfg.model.arch)))
    return {"from": str(init_from.resolve()), "weights_only": True}
