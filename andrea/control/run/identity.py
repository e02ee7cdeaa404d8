"""A run's identity: what its checkpoints' bytes mean, fixed at its first start and checked at every later one.

The model's arch and shape (every field that changes what the flat `[w | m | v]` means, not only n_params), the
optimizer (`train.optimizer`: what `m` and `v` hold, docs/formats.md), the lr schedule's kind (`train.schedule`:
cosine or wsd, a resume switching them would jump the lr), the tokenizer (its file's SHA-256) and the
seed (initialisation and data order). A resume whose configuration
would change one of them is refused in one line naming the field and both values, before anything is written;
deliberate changes keep their ways: `--set` of train-time keys, pivots for the data policy, a new run from a
checkpoint's weights (`andrea export`, then `train --init-from` the export: m = v = 0) for another optimizer.
The same identity binds the ways a checkpoint's m and v reach another run directory: `andrea branch`
(`check_branch`) and `train --init-from` a checkpoint (`check_init_from`).

Reads the ledger's `start` marker (its `identity` field: written by control/run/runtime.py at every kind of start,
append-only, so it survives a lost `run.toml`), else `run.toml`: for a run started before identities were recorded,
and for a ledger changed inside a checkpoint's history (`ledger_changed`: its start marker may be a changed line);
the newest checkpoint's ledger record (`step_N.ledger.json`), and `tokenizer.json` (or the file `data.tokenizer`
names). Writes nothing.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from andrea.config.schema import RunConfig
from andrea.config.check import ConfigError
from andrea.rundir import checkpoint as ckpt, names, regular, sidecars
from andrea.rundir.ledger import readable_entries
from andrea.rundir.ledger_seal import ledger_problem

MODEL_KEYS = ("arch", "n_layer", "n_head", "n_embd", "block_size", "vocab_size")
# what only that model reads (a modern model has no biases; its extras, andrea/model/modern.py, change its math)
ARCH_KEYS = {"gpt2": ("bias",), "modern": ("rope_base", "logit_softcap", "embed_norm", "qk_scale", "mlp",
                                           "value_embeds", "resid_lambdas", "smear", "backout")}
# What a record written before a field existed means by its absence: the only value there was then, so a resume
# that would change it is refused, not let through.
BEFORE_RECORDED = {"model.arch": "gpt2", "train.optimizer": "adamw", "train.schedule": "cosine",
                   "model.logit_softcap": 0.0, "model.embed_norm": False, "model.qk_scale": 1.0, "model.mlp": "swiglu",
                   "model.value_embeds": False, "model.resid_lambdas": False, "model.smear": False,
                   "model.backout": False}


def identity(cfg: RunConfig, tokenizer_sha256: str | None) -> dict[str, Any]:
    """The identity of a run trained with `cfg` and the tokenizer whose file hashes to `tokenizer_sha256`:
    `model.arch`, the shape, `model.bias` of a gpt2 model or `model.rope_base` and the extras of a modern one, the
    optimizer, the lr schedule's kind, the seed and the tokenizer. (A record written before a key was dropped still holds it; `changes` skips it.)"""
    keys = MODEL_KEYS + ARCH_KEYS[cfg.model.arch]
    out: dict[str, Any] = {f"model.{k}": getattr(cfg.model, k) for k in keys}
    out["train.optimizer"] = cfg.train.optimizer
    out["train.schedule"] = cfg.train.schedule  # cosine or wsd: a resume switching them would jump the lr
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
        return hashlib.sha256(regular.read_bytes(path)).hexdigest()
    except FileNotFoundError:
        return None


def run_tokenizer_sha256(run_dir: Path, cfg: RunConfig) -> str | None:
    """The SHA-256 of the tokenizer the run trains with: the file `data.tokenizer` names, else the run's own
    `tokenizer.json`; None while neither exists (a tokenizer not yet trained)."""
    if cfg.data.tokenizer == "bpe":
        return tokenizer_sha256(run_dir)
    try:
        return hashlib.sha256(Path(cfg.data.tokenizer).expanduser().read_bytes()).hexdigest()
    except OSError:
        return None


def recorded_identity(run_dir: Path) -> dict[str, Any] | None:
    """The identity the run recorded at its (latest) first step: the newest `start` marker's; None when it has none,
    or when the ledger's own lines are no evidence of it (`ledger_changed`: then `of_run` reads run.toml's)."""
    entries = readable_entries(run_dir / names.LEDGER_NAME)  # the start reports a line that is none (control/run/resume.py)
    starts = [i for i, e in enumerate(entries) if e.get("event") == "start" and isinstance(e.get("identity"), dict)]
    if not starts or ledger_changed(entries[starts[-1]:], run_dir):
        return None
    return entries[starts[-1]]["identity"]


def ledger_changed(since_start: list[dict], run_dir: Path) -> bool:
    """Whether the ledger was changed inside a history a checkpoint vouched for, so that its start marker may be
    a changed line (a flipped digit still parses: campaign seed 201 read `"model.n_layer":6` where the run wrote 2,
    and refused the run's own configuration as a change): a `gap` marker after the newest start marker (a start
    went past such a change with `--accept-ledger-gap`), or the ledger not holding what the newest checkpoint with
    a ledger record vouches for (the start that will be asked to accept it). `since_start`: the entries from the
    newest start marker on."""
    if any(e.get("event") == "gap" for e in since_start):
        return True
    records = [s for s, _ in ckpt.list_checkpoints(run_dir) if names.companion_path(run_dir, s, "ledger").exists()]
    if not records:
        return False
    step = records[-1]
    try:
        recorded = sidecars.read_json(names.companion_path(run_dir, step, "ledger"))
    except (sidecars.SidecarError, OSError):
        return False  # a damaged record: the checkpoint is passed over for it, and says so (rundir/checksum.py)
    if not isinstance(recorded, dict) or not isinstance(recorded.get("bytes"), int) \
            or not isinstance(recorded.get("xxh3_128"), str):
        return False
    return ledger_problem(run_dir / names.LEDGER_NAME, recorded, names.checkpoint_name(step)) is not None


def check_resume(run_dir: Path, cfg: RunConfig, saved: RunConfig | None) -> None:
    """Refuse (ConfigError, one line) a start of an existing run that would change its identity, or that has
    lost its `run.toml`; `saved` is the run's run.toml as read, None when it has none."""
    if not ckpt.list_checkpoints(run_dir):
        return  # nothing trained is kept: a start from step 0 is a new run, free to choose
    if saved is None:
        raise ConfigError(f"{run_dir / names.CONFIG_NAME}: missing, but the run holds checkpoints: its settings "
                          "(learning rate, schedule, data) are the run's; restore the file (from a copy, or "
                          "`andrea restore`) instead of resuming under a preset's")
    changed = changes(of_run(run_dir, saved), identity(cfg, tokenizer_sha256(run_dir)))
    if changed:
        raise ConfigError(f"{run_dir}: resuming would change {'; '.join(changed)}: these fix what the checkpoints "
                          f"mean and were set at the run's first start ({NEW_RUN})")


NEW_RUN = ("a new run from a checkpoint's weights: `andrea export RUN_DIR --step S --out DIR`, then `andrea train "
           "--init-from DIR` in a new run directory")


def of_run(run_dir: Path, saved: RunConfig | None = None) -> dict[str, Any] | None:
    """What a run directory's checkpoints mean: its recorded identity, else its run.toml's (`saved` when the caller
    has read it; a run started before identities were recorded), None for a directory that is no run (a checkpoint
    file kept on its own). A field the record predates reads as BEFORE_RECORDED says."""
    recorded = recorded_identity(run_dir)
    if recorded is None:
        if saved is None and (run_dir / names.CONFIG_NAME).is_file():
            from andrea.config.load import run_config
            saved = run_config(run_dir)
        recorded = identity(saved, None) if saved is not None else None
    return {**BEFORE_RECORDED, **recorded} if recorded is not None else None


def check_branch(parent: Path, cfg: RunConfig) -> None:
    """Refuse (one line) a branch whose configuration would change its parent's identity: the branch continues the
    parent's checkpoint and ledger, and its first start would refuse the change (`check_resume`)."""
    recorded = of_run(parent)
    changed = changes(recorded, identity(cfg, tokenizer_sha256(parent))) if recorded is not None else []
    if changed:
        raise ConfigError(f"branch: would change {'; '.join(changed)}: a branch continues {parent}'s checkpoints, "
                          f"which these fix ({NEW_RUN})")


def check_init_from(init_from: Path, cfg: RunConfig, tokenizer: str | None = None) -> None:
    """Refuse (one line) `--init-from` a checkpoint whose run meant other things by its bytes: the start continues
    its w, m and v (control/run/resume.py), so the arch, the shape, the optimizer and the tokenizer (its embedding
    rows are token ids) must be this run's; `tokenizer`: this run's tokenizer's SHA-256 where it is known yet
    (`run_tokenizer_sha256`; a tokenizer trained at the start is checked once it is, `check_init_from_tokenizer`).
    Its run is the checkpoint's directory; a checkpoint kept outside any run is taken on its parameter count alone.
    The seed may differ: the new run draws its own data order; so may the lr schedule. (Weights imported from an
    export are a deliberate new start: model/init_from.py warns of another tokenizer there, and checks their
    shape.)"""
    recorded = of_run(init_from.parent)
    if recorded is None:
        return
    recorded.pop("train.seed", None)  # the new run's own
    recorded.pop("train.schedule", None)  # its own too: the schedule gives no byte of w, m or v another meaning
    _refuse(init_from, changes(recorded, identity(cfg, tokenizer)))


def check_init_from_tokenizer(init_from: Path, tokenizer: str | None) -> None:
    """At the start, once the run's tokenizer exists (trained or read): `check_init_from`'s tokenizer check for
    `--init-from` a checkpoint (`step_NNNNNN.bin`; weights are model/init_from.py's). ConfigError, one line."""
    recorded = of_run(init_from.parent) if names.step_of(init_from) is not None and tokenizer is not None else None
    key = "tokenizer.sha256"
    if recorded is not None and key in recorded:
        _refuse(init_from, changes({key: recorded[key]}, {key: tokenizer}))


def _refuse(init_from: Path, changed: list[str]) -> None:
    if changed:
        theirs = init_from.parent / names.TOKENIZER_NAME
        advice = (f"train with its tokenizer (--set data.tokenizer={theirs}) in a fresh run directory"
                  if any(c.startswith("tokenizer.sha256 ") for c in changed) else NEW_RUN)
        raise ConfigError(f"{init_from}: --init-from would change {'; '.join(changed)}: its w, m and v mean what "
                          f"its run's identity says ({advice})")
