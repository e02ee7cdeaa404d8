"""The run directory's JSON sidecars, each written atomically (rundir/atomic.py).

Writes:
    .state.json               the data proxy's live state (bandit, phase, policy fingerprint, step) — reset at a
                              pivot (docs/formats.md#the-sidecars); rewritten at every checkpoint and at exit
    step_NNNNNN.state.json    the same state as of that checkpoint, so resuming from any retained checkpoint
                              is exact (deleted with its checkpoint by retention)
    .samples.json             the last `sample.keep` sample audits: {"audits": [{"step", "prompt", "text"}]}
    archive/phase-K/          `.state.json` and `.samples.json` of a finished policy phase
A reader sees the old or the new file, never half.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from andrea.errors import UserError
from andrea.rundir import jsonfile
from andrea.rundir.atomic import fsync_dir, write_atomic
from andrea.rundir.names import ARCHIVE_DIR, SAMPLES_NAME, STATE_NAME, companion_path


class SidecarError(UserError, ValueError):
    """A sidecar that cannot be used; one line naming the file and the problem."""


def json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, allow_nan=False) + "\n").encode()


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json_bytes(obj))


def read_json(path: Path) -> Any | None:
    """The parsed file, None if it does not exist; SidecarError on garbage (NaN and Infinity included)."""
    return jsonfile.read_json(path, SidecarError, invalid="not valid JSON: {e}", constants=False)


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
