"""Models that leave andrea: a checkpoint's weights as a Hugging Face GPT-2 directory (or numpy arrays), which
andrea/model/init_from.py reads back as the starting point of a new run (`train --init-from`). A modern run
(`model.arch = "modern"`) exports as a `Qwen3ForCausalLM` directory instead: its names, config and norm weights
are andrea/model/qwen3.py's; the files, the tokenizer, npz and every refusal are the same as below. With a model
extra Qwen3 cannot express (logit_softcap, embed_norm, mlp = relu2, and the parts value_embeds, resid_lambdas, smear,
backout) the directory also holds modeling_andrea.py and config.json names it (model_type andrea_modern,
auto_map): andrea/model/hf_modeling.py.

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
Import (`train --init-from`) is andrea/model/init_from.py's.
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
from andrea.model import hf_modeling, qwen3
from andrea.model.arch import layout_for
from andrea.model.gpt import LayerNorm, ParamSpec, n_params
from andrea.rundir import atomic, checkpoint as ckpt, names, regular

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
    """config.json: GPT2LMHeadModel's for a gpt2 run (refusing bias = false), Qwen3ForCausalLM's for a modern one,
    or andrea's own modeling file's for a modern one with an extra Qwen3 has not (andrea/model/hf_modeling.py)."""
    return hf_modeling.config(cfg, eot) if cfg.arch == "modern" else gpt2_config(cfg, eot)


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
    return {"tokenizer.json": regular.read_bytes(path), "tokenizer_config.json": _json(config),
            "special_tokens_map.json": _json(special)}, codec.eot


def pick_checkpoint(run_dir: Path, n: int, step: int | None, purpose: str = "export") -> Path:
    """step_S.bin when `step` is given (present; read_payload validates it), else the newest checkpoint that passes
    deep validation, newer invalid ones skipped with a warning. `purpose` words the refusals (`andrea eval` too)."""
    if step is not None:
        if step < 0:
            raise ExportError(f"--step {step}: a checkpoint's step is >= 0")
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


def average_weights(payloads: list[np.ndarray], n: int) -> np.ndarray:
    """The mean of the payloads' weights (their first n floats), summed in float64, as float32: one payload's are
    returned as they are, bit for bit."""
    if len(payloads) == 1:
        return payloads[0][:n]
    total = np.zeros(n, dtype=np.float64)
    for p in payloads:
        total += p[:n]
    return (total / len(payloads)).astype(np.float32)


def averaged_steps(run_dir: Path, newest: int, k: int) -> list[int]:
    """The steps of the k retained checkpoints up to `newest` (its own included), oldest first; refused in one
    line when the run keeps fewer."""
    steps = [s for s, _ in ckpt.list_checkpoints(run_dir) if s <= newest][-k:]
    if len(steps) < k:
        raise ExportError(f"--average {k}: {run_dir} keeps {len(steps)} checkpoint(s) up to step {newest} "
                          f"({', '.join(map(str, steps)) or 'none'})")
    return steps


def export_run(run_dir: Path, out: Path, step: int | None = None, fmt: str = "safetensors",
               average: int = 1) -> Path:
    """Write the export directory `out` from a run's checkpoint (the newest valid one unless `step`), or from the
    mean of the weights of the `average` retained checkpoints ending there (a tail average without an anneal)."""
    from andrea.config.load import run_config
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt}: not one of {', '.join(FORMATS)}")
    if average < 1:
        raise ExportError(f"--average {average}: must be at least 1 checkpoint")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out}: exists and is not an empty directory; export writes a new one")
    cfg = run_config(run_dir)
    config = hf_config(cfg.model, None)  # refuses a gpt2 run's bias=false before reading anything large
    layout = layout_for(cfg.model)
    path = pick_checkpoint(run_dir, n_params(layout), step)
    header_step, payload = ckpt.read_payload(path, n_params(layout))
    steps = averaged_steps(run_dir, header_step, average) if average > 1 else [header_step]
    payloads = [payload] + [ckpt.read_payload(run_dir / names.checkpoint_name(s), n_params(layout))[1]
                            for s in steps[:-1]]
    weights = average_weights(payloads, n_params(layout))
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
    if cfg.model.arch == "modern" and not hf_modeling.stock(cfg.model):
        files[hf_modeling.FILE_NAME] = hf_modeling.MODELING.encode()
    if fmt == "safetensors":
        from safetensors.numpy import save_file
        tensors = hf_state(layout, weights, cfg.model)
        meta = {"format": "pt", "andrea_step": str(header_step), "andrea_run": str(run_dir.resolve())}
        if average > 1:
            meta["andrea_average_of_steps"] = ",".join(map(str, steps))
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
