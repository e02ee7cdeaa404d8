"""A run's identity: what its checkpoints' bytes mean, fixed at its first start and checked at every later one.

The model's arch and shape (every field that changes what the flat `[w | m | v]` means, not only n_params), the
optimizer (`train.optimizer`: what `m` and `v` hold, docs/formats.md), the tokenizer (its file's SHA-256) and the
seed (initialisation and data order). A resume whose configuration
would change one of them is refused in one line naming the field and both values, before anything is written;
deliberate changes keep their ways: `--set` of train-time keys, pivots for the data policy, `andrea branch` for
a new model from a checkpoint.

Reads the ledger's `start` marker (its `identity` field: written by run/runtime.py at step 0, append-only,
so it survives a lost `run.toml`), else `run.toml` for a run started before identities were recorded, and
`tokenizer.json`. Writes nothing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from andrea.config.schema import RunConfig
from andrea.config.check import ConfigError
from andrea.rundir import checkpoint as ckpt, names
from andrea.rundir.ledger import readable_entries

MODEL_KEYS = ("arch", "n_layer", "n_head", "n_embd", "block_size", "vocab_size", "bias")
MODERN_KEYS = ("rope_base",)  # what only the modern model's math reads
# What a record written before a field existed means by its absence: the only value there was then, so a resume
# that would change it is refused, not let through.
BEFORE_RECORDED = {"model.arch": "gpt2", "train.optimizer": "adamw"}


def identity(cfg: RunConfig, tokenizer_sha256: str | None) -> dict[str, Any]:
    """The identity of a run trained with `cfg` and the tokenizer whose file hashes to `tokenizer_sha256`:
    `model.arch`, the shape, `model.rope_base` for a modern model, the optimizer, the seed and the tokenizer."""
    keys = MODEL_KEYS + (MODERN_KEYS if cfg.model.arch == "modern" else ())
    out: dict[str, Any] = {f"model.{k}": getattr(cfg.model, k) for k in keys}
    out["train.optimizer"] = cfg.train.optimizer
    out["train.seed"] = cfg.train.seed
    if tokenizer_sha256 is not None:
        out["tokenizer.sha256"] = tokenizer_sha256
    return out


def changes(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One phrase per field whose value differs, in the order of `recorded` (a field either side lacks is not
    compared: a tokenizer not yet trained, a record from an older version)."""
    return [f"{key} from {recorded[key]!r} to {current[key]!r}" for key in recorded
            if key in current and recorded[key] != current[key]]


def tokenizer_sha256(run_dir: Path) -> str | None:
    path = run_dir / names.TOKENIZER_NAME
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def recorded_identity(run_dir: Path) -> dict[str, Any] | None:
    """The identity the run recorded at its (latest) first step: the newest `start` marker's."""
    entries = readable_entries(run_dir / names.LEDGER_NAME)  # the start reports a line that is none (run/resume.py)
    starts = [e["identity"] for e in entries if e.get("event") == "start" and isinstance(e.get("identity"), dict)]
    return starts[-1] if starts else None


def check_resume(run_dir: Path, cfg: RunConfig, saved: RunConfig | None) -> None:
    """Refuse (ConfigError, one line) a start of an existing run that would change its identity, or that has
    lost its `run.toml`; `saved` is the run's run.toml as read, None when it has none."""
    if not ckpt.list_checkpoints(run_dir):
        return  # nothing trained is kept: a start from step 0 is a new run, free to choose
    recorded = recorded_identity(run_dir)
    if saved is None:
        raise ConfigError(f"{run_dir / names.CONFIG_NAME}: missing, but the run holds checkpoints: its settings "
                          "(learning rate, schedule, data) are the run's; restore the file (from a copy, or "
                          "`andrea restore`) instead of resuming under a preset's")
    if recorded is None:
        recorded = identity(saved, None)  # a run started before identities were recorded
    recorded = {**BEFORE_RECORDED, **recorded}
    changed = changes(recorded, identity(cfg, tokenizer_sha256(run_dir)))
    if changed:
        raise ConfigError(f"{run_dir}: resuming would change {'; '.join(changed)}: these fix what the checkpoints "
                          "mean and were set at the run's first start (`andrea branch` starts a new run from a "
                          "checkpoint)")
