"""Every name in a run directory, and which module writes each file (docs/formats.md#the-run-directory).

Reads and writes nothing: the one place that knows a run's files, so that a command, the trainer, the
integrity checks and a replica agree on them.

    RUN_DIR/
      step_NNNNNN.bin          a checkpoint (rundir/checkpoint.py)
      step_NNNNNN.<kind>.json  its companions: sum (its checksum, rundir/checksum.py), state (the bandit,
                               rundir/sidecars.py), guard (control/guard/rollback.py), ledger (the ledger's length
                               and hash as the checkpoint vouches for them, rundir/ledger.py's `seal`)
      spare.ckpt               a released checkpoint whose blocks the next commit overwrites (rundir/spare.py)
      .loss.json               the loss ledger, append-only (rundir/ledger.py)
      .state.json              the data proxy's live state, reset at a pivot (rundir/sidecars.py)
      .samples.json            recent sample audits, reset at a pivot (rundir/sidecars.py)
      run.toml                 the resolved configuration (rundir/sidecars.py writes it atomically)
      policy.next.toml         a hot pivot's policy, waiting for the trainer (control/mixture/pivot.py)
      tokenizer.json           the run's BPE tokenizer (data/preparation.py)
      data/                    token files and manifest.json (data/splits.py, data/manifest.py)
      archive/phase-K/         the sidecars of a finished policy phase (rundir/sidecars.py)
      quarantine/              checkpoints that failed validation at a start, with their companions, and
                               ledger bytes a start cut (.loss.json.cut-at-B) (control/run/resume.py): evidence,
                               never deleted
      tb/                      TensorBoard event files when enabled (control/observe/tensorboard.py)
      train.lock, train.pid    one trainer per directory (rundir/runlock.py)
      .share-probe.<nonce>     for a moment at a torchrun start: does every rank see this directory
                               (control/parallel/sharing.py)
      .replica.json            the replica's newest step and lag, for `status` (control/replica/replicator.py through
                               control/replica/remote.py, when checkpoint.replica is set)
      .wandb.json              the W&B run's id and the newest step logged to it (control/observe/wandb_log.py)
      wandb/                   W&B's own files when log.wandb is on (offline runs, logs)
      restore.partial          an `andrea restore` in progress (commands/restore.py): train refuses, restore resumes
Any file written atomically passes through `<name>.tmp` (rundir/atomic.py, rundir/checkpoint_write.py).
"""

from __future__ import annotations

import re
from pathlib import Path

LEDGER_NAME = ".loss.json"
STATE_NAME = ".state.json"
SAMPLES_NAME = ".samples.json"
CONFIG_NAME = "run.toml"
NEXT_POLICY_NAME = "policy.next.toml"
TOKENIZER_NAME = "tokenizer.json"
DATA_DIR = "data"
MANIFEST_NAME = "manifest.json"
ARCHIVE_DIR = "archive"
QUARANTINE_DIR = "quarantine"
TB_DIR = "tb"
SPARE_NAME = "spare.ckpt"
LOCK_NAME = "train.lock"
PID_NAME = "train.pid"
REPLICA_STATUS_NAME = ".replica.json"
RESTORING_NAME = "restore.partial"
WANDB_STATE_NAME = ".wandb.json"
WANDB_DIR = "wandb"
TMP_SUFFIX = ".tmp"
PROBE_PREFIX = ".share-probe."

CHECKPOINT_RE = re.compile(r"^step_(\d{6,})\.bin$")
COMPANION_RE = re.compile(r"^step_\d{6,}\.[a-z]+\.json$")
# The temporary names of andrea's own atomic writes (`<name>.tmp`), in the run directory and in data/: a start
# removes exactly these, never a user's `notes.tmp`.
OWN_FILES = {STATE_NAME, SAMPLES_NAME, CONFIG_NAME, NEXT_POLICY_NAME, TOKENIZER_NAME, PID_NAME,
             REPLICA_STATUS_NAME, WANDB_STATE_NAME}
DATA_FILE_RE = re.compile(r"^(manifest\.json|[\w.-]+\.plan\.json)$")


def checkpoint_name(step: int) -> str:
    """`step_` + the step zero-padded to 6 digits (more digits past 999,999) + `.bin`."""
    return f"step_{step:06d}.bin"


def step_of(path: str | Path) -> int | None:
    """The step a checkpoint's name carries; None for any other name."""
    match = CHECKPOINT_RE.match(Path(path).name)
    return int(match.group(1)) if match else None


def companion_path(run_dir: Path, step: int, kind: str) -> Path:
    """`step_NNNNNN.<kind>.json`: a file that belongs to one checkpoint (kind: state, guard)."""
    return run_dir / f"{Path(checkpoint_name(step)).stem}.{kind}.json"


def companions(run_dir: Path, step: int) -> list[Path]:
    """Every companion of one checkpoint on disk: copied with it by a branch, deleted with it by retention."""
    return sorted(run_dir.glob(f"{Path(checkpoint_name(step)).stem}.*.json"))


def is_own_tmp(name: str, in_data: bool = False) -> bool:
    """Whether `name` is the temporary file of one of andrea's own atomic writes (run directory or data/)."""
    if not name.endswith(TMP_SUFFIX):
        return False
    base = name[:-len(TMP_SUFFIX)]
    if in_data:
        return bool(DATA_FILE_RE.match(base))
    return base in OWN_FILES or bool(CHECKPOINT_RE.match(base) or COMPANION_RE.match(base))


def tmp_path(path: Path) -> Path:
    """The temporary name an atomic write of `path` goes through."""
    return path.with_name(path.name + TMP_SUFFIX)
