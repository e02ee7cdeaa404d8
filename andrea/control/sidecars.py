"""The run directory's JSON sidecars and small files, each written atomically.

Writes:
    .state.json               the data proxy's live state (bandit, phase, policy fingerprint, step) — reset at a
                              pivot (SPEC §6); rewritten at every checkpoint and at exit
    step_NNNNNN.state.json    the same state as of that checkpoint, so resuming from any retained checkpoint
                              is exact (deleted with its checkpoint by retention)
    .samples.json             the last `sample.keep` sample audits: {"audits": [{"step", "prompt", "text"}]}
    run.toml                  the resolved configuration the run trains with
    archive/phase-K/          `.state.json` and `.samples.json` of a finished policy phase
Atomic = temporary file, fsync, rename, fsync the directory: a reader sees the old or the new file, never half.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

from andrea.checkpoint import checkpoint_name, fsync_dir

STATE_NAME, SAMPLES_NAME, CONFIG_NAME, ARCHIVE_DIR = ".state.json", ".samples.json", "run.toml", "archive"


class SidecarError(ValueError):
    """A sidecar that cannot be used; one line naming the file and the problem."""


def write_atomic(path: Path, data: bytes) -> None:
    """One file: temporary, fsync, rename, directory fsync (write_many of one)."""
    write_many({path: data})


def write_many(files: dict[Path, bytes]) -> None:
    """Atomic writes of several files with one fsync per directory: each temporary file written and fsynced,
    then each renamed, then each directory fsynced once. Every file is still old-or-new, never half;
    on return all are durable (what a checkpoint's companions need before its `.bin` is renamed)."""
    tmps = {path: path.with_name(path.name + ".tmp") for path in files}
    try:
        for path, data in files.items():
            with open(tmps[path], "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        for path, tmp in tmps.items():
            os.rename(tmp, path)
    except BaseException:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)  # a full disk must not also keep half files
        raise
    for directory in {path.parent for path in files}:
        fsync_dir(directory)


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode()


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json_bytes(obj))


def read_json(path: Path) -> Any | None:
    """The parsed file, None if it does not exist; SidecarError on garbage."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise SidecarError(f"{path}: cannot read: {e}") from None

    def no_constants(name: str) -> float:
        raise ValueError(f"{name} is not allowed")

    try:
        return json.loads(text, parse_constant=no_constants)
    except ValueError as e:
        raise SidecarError(f"{path}: not valid JSON: {e}") from None


def companion_path(run_dir: Path, step: int, kind: str) -> Path:
    """`step_NNNNNN.<kind>.json`: a file that belongs to one checkpoint (kind: state, guard)."""
    return run_dir / f"{Path(checkpoint_name(step)).stem}.{kind}.json"


def companions(run_dir: Path, step: int) -> list[Path]:
    """Every companion of one checkpoint on disk: copied with it by a branch, deleted with it by retention."""
    return sorted(run_dir.glob(f"{Path(checkpoint_name(step)).stem}.*.json"))


def checkpoint_state_path(run_dir: Path, step: int) -> Path:
    return companion_path(run_dir, step, "state")


def append_audit(run_dir: Path, audits: list[dict[str, Any]], keep: int) -> None:
    """Add sample audits to .samples.json, keeping the newest `keep`; a garbage file is replaced."""
    path = run_dir / SAMPLES_NAME
    try:
        old = read_json(path) or {}
    except SidecarError:
        old = {}
    kept = [a for a in old.get("audits", []) if isinstance(a, dict)] if isinstance(old, dict) else []
    write_json(path, {"audits": (kept + audits)[-keep:]})


def next_phase_dir(run_dir: Path) -> tuple[int, Path]:
    archive = run_dir / ARCHIVE_DIR
    k = 0
    while (archive / f"phase-{k}").exists():
        k += 1
    return k, archive / f"phase-{k}"


def archive_phase(run_dir: Path) -> Path:
    """Move .state.json and .samples.json (only those: never .loss.json) into archive/phase-K/."""
    _, dest = next_phase_dir(run_dir)
    dest.mkdir(parents=True)
    for name in (STATE_NAME, SAMPLES_NAME):
        if (run_dir / name).exists():
            shutil.move(str(run_dir / name), dest / name)
    fsync_dir(dest)
    fsync_dir(run_dir)
    return dest


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
