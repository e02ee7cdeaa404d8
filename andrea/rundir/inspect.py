"""What a run directory holds, read without a trainer's help: whether a path is a run, its life stage, the
newest step in the ledger's tail, its checkpoints. `status` (commands/operate.py) and `ctl` build on it.

Reads `train.pid` and the `train.lock` flock (rundir/runlock.py), the tail of `.loss.json`, the checkpoints'
names, sizes and 8-byte headers, and `data/manifest.json`; writes nothing. A path that is not a run directory (`run_dir_problem`) is refused
in one line before anything is read, and so is a run with something other than a regular file at one of its own
file names (`special_files`: a FIFO there would hold a reader for good).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from andrea.errors import UserError
from andrea.rundir import regular
from andrea.rundir.checkpoint import CheckpointError, list_checkpoints, validate
from andrea.rundir.ledger_seal import tail_step
from andrea.rundir.names import (CHECKPOINT_RE, COMPANION_RE, CONFIG_NAME, DATA_DIR, LEDGER_NAME, LOCK_NAME,
                                 MANIFEST_NAME, NEXT_POLICY_NAME, PID_NAME, REPLICA_STATUS_NAME, RESTORING_NAME,
                                 SAMPLES_NAME, STATE_NAME, TOKENIZER_NAME, WANDB_STATE_NAME)
from andrea.rundir.runlock import is_locked, read_pid

# What makes a directory a run: any of these files (run.toml from the first start on; tokenizer.json once the
# data is prepared; the ledger from the first start on), a checkpoint, or a trainer holding train.lock (a start
# still preparing its data has written nothing else yet).
RUN_FILES = (CONFIG_NAME, LEDGER_NAME, TOKENIZER_NAME)
PREPARED_FILES = (TOKENIZER_NAME, DATA_DIR)  # what a first start (or data preparation) leaves before step 1


class NotARunError(UserError, FileNotFoundError):
    """A path given as a run directory that is not one: one line naming it (an OSError: exit 1)."""


def run_dir_problem(run_dir: Path) -> str | None:
    """Why `run_dir` cannot be read as a run directory, in words; None when it is one."""
    if not run_dir.exists():
        return "no such directory"
    if not run_dir.is_dir():
        return "not a directory"
    if any((run_dir / name).exists() for name in RUN_FILES) or list_checkpoints(run_dir) \
            or is_locked(run_dir):
        return None
    return f"not a run directory (no {', '.join(RUN_FILES)}, step_NNNNNN.bin or running trainer)"


def require_run_dir(run_dir: Path) -> Path:
    problem = run_dir_problem(run_dir)
    if problem is not None:
        raise NotARunError(f"{run_dir}: {problem}")
    refuse_special_files(run_dir)
    return run_dir


# The names a run's own files take (rundir/names.py), beside the checkpoints and their companions; spare.ckpt has
# its own rule (rundir/spare.py: something else there is left alone, never reused).
OWN_NAMES = {CONFIG_NAME, LEDGER_NAME, STATE_NAME, SAMPLES_NAME, TOKENIZER_NAME, NEXT_POLICY_NAME, PID_NAME,
             LOCK_NAME, REPLICA_STATUS_NAME, WANDB_STATE_NAME, RESTORING_NAME}


def special_files(run_dir: Path) -> list[tuple[Path, str]]:
    """Each entry at one of a run's own file names (its own names, a checkpoint, a companion, a file of data/)
    that is not a regular file, with what it is (a symbolic link counts as what it ends at): a FIFO there would
    hold any reader that opens it for good."""
    found = []
    for d, in_data in ((run_dir, False), (run_dir / DATA_DIR, True)):
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if not (in_data or e.name in OWN_NAMES or CHECKPOINT_RE.match(e.name) or COMPANION_RE.match(e.name)):
                continue
            try:
                kind = regular.kind_of(os.stat(e.path).st_mode)
            except FileNotFoundError:  # gone meanwhile, or a dangling link: a reader says so itself
                continue
            if kind is not None and not (in_data and kind == "a directory"):
                found.append((Path(e.path), kind))
    return found


def refuse_special_files(run_dir: Path) -> None:
    """NotRegularFile for the first of `special_files`: every command refuses such a run in one line, before it
    opens anything (the readers refuse it again on their own, rundir/regular.py: this check is by name)."""
    for path, kind in special_files(run_dir)[:1]:
        raise regular.NotRegularFile(path, kind)


def run_state(running: bool, step: int | None, n_checkpoints: int, prepared: bool, partly: bool = False) -> str:
    """The run's life stage for `status`, from plain facts:
    starting  a trainer (or `andrea prepare`) holds the lock and has recorded no step yet
    training  a trainer holds the lock and has recorded steps
    prepared  no trainer, no step, no checkpoint; tokenizer.json and data/ are in place, every arm complete
    preparing no trainer, no step, no checkpoint; a preparation stopped part-way (`andrea prepare` continues it)
    empty     no trainer, no step, no checkpoint, no prepared data (e.g. a first start stopped early)
    stopped   no trainer; steps or checkpoints are there (resumable)"""
    if running:
        return "starting" if step is None else "training"
    if step is None and n_checkpoints == 0:
        return "preparing" if partly else "prepared" if prepared else "empty"
    return "stopped"


def last_ledger_step(run_dir: Path) -> int | None:
    """The step of the newest complete step entry, read from the file's tail only."""
    return tail_step(run_dir / LEDGER_NAME)


def unfinished_arms(run_dir: Path) -> bool:
    """Whether data/manifest.json names an arm whose preparation has not finished (andrea/data/manifest.py)."""
    try:
        arms = json.loads(regular.read_text(run_dir / DATA_DIR / MANIFEST_NAME))["arms"]
        return any(not a.get("complete") for a in arms.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def status(run_dir: Path) -> dict:
    """The live part of a run's report (cheap: the ledger's tail only; polled by `ctl`'s --timeout wait)."""
    running = is_locked(run_dir)
    found = list_checkpoints(run_dir)
    step = last_ledger_step(run_dir)
    prepared = all((run_dir / name).exists() for name in PREPARED_FILES)
    partly = unfinished_arms(run_dir)
    whole = [p.name for _, p in found if whole_file(p)]
    return {"run_dir": str(run_dir), "state": run_state(running, step, len(found), prepared and not partly, partly),
            "running": running,
            "pid": read_pid(run_dir) if running else None, "step": step,
            "newest_checkpoint": whole[-1] if whole else None, "checkpoints": [p.name for _, p in found],
            "not_whole": [p.name for _, p in found if p.name not in whole]}


def whole_file(path: Path) -> bool:
    """Whether a checkpoint's size and header agree (a cut or padded file does not; `verify` says why). Its bytes
    are not read: a resume checks them, and status stays cheap."""
    try:
        validate(path)
        return True
    except CheckpointError:
        return False
