"""The run directory's JSON sidecars, each written atomically (rundir/atomic.py).

Writes:
    .state.json               the data proxy's live state (bandit, phase, policy fingerprint, step) — reset at a
                              pivot (docs/formats.md#the-sidecars); rewritten at every checkpoint and at exit
    step_NNNNNN.state.json    the same state as of that checkpoint, so resuming from any retained checkpoint
                              is exact (deleted with its checkpoint by retention)
    .samples.json             the last `sample.keep` sample audits: {"audits": [{"step", "prompt", "text"}]}
    archive/phase-K/          `.state.json` and `.samples.json` of a finished policy phase
A reader sees the old or the new file, never half.

A companion a run trusts to continue its trajectory is sealed (`seal`): it carries `"checksum"`, the xxh3-128 of its
own content (every other field, as canonical JSON: sorted keys, no spaces), so a bit that changes after it was
written — one that leaves valid JSON and a value a field check accepts, a digit of a data offset or of an observed
loss — is found (`seal_problem`, `unseal`, `opened`), never used. The guard's `step_NNNNNN.guard.json` (its data
offset and lr scale): every reader of the checkpoint refuses it like a bad one (rundir/checkpoint.py), and a start
falls back to the next older one. The data proxy's `step_NNNNNN.state.json` and `.state.json` (which rows every
later batch reads): a damaged one is passed over like any unusable state (control/run/resume.py: the live state if
it is intact and at that step, else a fresh bandit, in one warning line). A companion from before seals has no
`"checksum"` and a `"version"` of 1 or none (the state's had none); a sealed kind's version is 2 or later, so no
single flipped bit makes a sealed file read as one from before seals.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import xxhash

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


SEAL = "checksum"  # the field of a sealed companion that holds the xxh3-128 of the rest
UNSEALED_VERSION = 1  # a companion of this format version (or of none) was written before seals (a sealed kind's: 2+)


def _digest(obj: dict) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(obj, sort_keys=True, separators=(",", ":"),
                                                allow_nan=False).encode())


def seal(obj: dict) -> dict:
    """`obj` with its checksum (`SEAL`: the xxh3-128 of its canonical JSON), for a companion a run trusts."""
    return {**obj, SEAL: _digest(obj)}


def unseal(obj: Any, source: str) -> dict:
    """A sealed companion as read, without its checksum; SidecarError naming `source` when it is not an object,
    has no checksum or its content is not what was sealed (a bit changed after the write)."""
    if not isinstance(obj, dict):
        raise SidecarError(f"{source}: not a JSON object")
    if not isinstance(obj.get(SEAL), str):
        raise SidecarError(f"{source}: no {SEAL!r} field: not a sealed companion, or a bit changed its name")
    body = {k: v for k, v in obj.items() if k != SEAL}
    if _digest(body) != obj[SEAL]:
        raise SidecarError(f"{source}: its content does not match its checksum (recorded {obj[SEAL]}, content "
                           f"{_digest(body)}): a bit changed after it was written")
    return body


def opened(obj: Any, source: str) -> Any:
    """A sealed companion as read (`read_json`'s value), its seal checked and removed. One of format version 1
    (`"version": 1`, UNSEALED_VERSION, or no version at all) without a seal predates seals and passes as it is (no
    single bit turns the version 2 of a sealed kind into a 1, or removes both its version and its seal); None (no
    file) is None. SidecarError naming `source`: the seal is broken or missing."""
    if obj is None or (isinstance(obj, dict) and obj.get("version", UNSEALED_VERSION) == UNSEALED_VERSION
                       and SEAL not in obj):
        return obj
    return unseal(obj, source)


def seal_problem(path: Path) -> str | None:
    """Why the sealed companion at `path` is damaged (no JSON, or `opened` refuses it), in words; None when it is
    intact, absent or from before seals. Every reader of a checkpoint asks (rundir/checkpoint.py): a checkpoint
    whose guard companion is damaged is refused like a bad one."""
    try:
        opened(read_json(path), str(path))
    except SidecarError as e:
        return str(e)
    return None


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
