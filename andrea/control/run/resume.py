"""Where a run starts again: the checkpoint it resumes from, and the data proxy as of that checkpoint.

Reads checkpoints (andrea/rundir/checkpoint.py: names, sizes, headers, values), `step_NNNNNN.state.json` and
`.state.json` (rundir/sidecars.py); moves checkpoints that failed validation, newer than the one it resumes
from, into `quarantine/` (the run would commit those steps again over the evidence). Checks `.loss.json` against
the checkpoint's ledger record (`check_ledger`: refuses, records a `gap`, or cuts unreadable lines after what the
checkpoint vouches for, keeping them as `quarantine/.loss.json.cut-at-B`). Used at the start of a process and by
the divergence guard's rollback (control/run/runtime.py), which resumes in-process from its known-good checkpoint.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from andrea.config.schema import RunConfig
from andrea.control.mixture.bandit import BanditStateError
from andrea.control.mixture.proxy import DataProxy
from andrea.rundir import atomic, checkpoint as ckpt, names, regular, sidecars
from andrea.rundir.ledger import LedgerError, marker, unlisted_lines, unreadable_lines, unreadable_tail
from andrea.rundir.ledger_seal import ledger_problem

log = logging.getLogger("andrea.control.run")


class OtherModelsCheckpoints(ckpt.CheckpointError):
    """A start that finds only checkpoints of another model in its run directory: the command's configuration does
    not fit the run (a forgotten `--preset`), so it exits 2, as every configuration error does (README)."""

    exit_code = 2


def resume_point(run_dir: Path, init_from: Path | None, n: int,
                 skipped_out: list[str] | None = None) -> tuple[ckpt.CheckpointInfo, np.ndarray] | None:
    """The checkpoint to start from and its payload, checked as read (`ckpt.load`: the file is read once):
    `--init-from`'s, else the newest valid one in `run_dir`, else None (a fresh start). Refuses what would
    silently bury a run: checkpoints newer than `--init-from`'s (two timelines in one directory), or checkpoints
    none of which fits this model (exit 2 when every one is a sound checkpoint of another model: the configuration's
    error; 1 when any is damaged). `skipped_out` receives the newer checkpoints' failures ("PATH: reason"), for the
    incident markers (rundir/incidents.py)."""
    if init_from is not None:
        info, payload = ckpt.load(init_from, n)
        newer = [p.name for s, p in ckpt.list_checkpoints(run_dir) if s > info.step]
        if newer:
            raise ckpt.CheckpointError(f"{run_dir}: holds checkpoints newer than {info.path.name} "
                                       f"({newer[-1]}); use `andrea branch` or move them away first")
        return info, payload
    errors: list[ckpt.CheckpointError] = []
    info, payload, skipped = ckpt.newest_loaded(run_dir, n, errors)
    if info is None and skipped:  # e.g. a forgotten --preset
        refusal = OtherModelsCheckpoints if all(isinstance(e, ckpt.OtherModelError) for e in errors) \
            else ckpt.CheckpointError
        raise refusal(f"{skipped[0]} (no checkpoint in {run_dir} fits this model; "
                      "refusing to start over in a run directory that holds checkpoints)")
    for line in skipped:
        log.warning("skipping invalid checkpoint, resuming from an older one: %s", line)
    if skipped_out is not None:
        skipped_out += skipped
    return (info, payload) if info is not None else None


def set_aside_newer(run_dir: Path, info: ckpt.CheckpointInfo) -> list[str]:
    """Checkpoints newer than the one resumed from failed validation (resume_point skipped them); the run will
    commit those steps again, so they move out of its way, kept as evidence. Called once the start's checks
    have passed: a start that is refused moves nothing. Returns the names moved."""
    moved = []
    for s, path in ckpt.list_checkpoints(run_dir):
        if s > info.step:
            log.warning("%s: moved to %s/ with its companions (kept as evidence, never deleted)", path.name,
                        quarantine(run_dir, path))
            moved.append(path.name)
    return moved


def check_ledger(run_dir: Path, info: ckpt.CheckpointInfo | None, accept_gap: bool) -> list[dict]:
    """The ledger at a start, so that it never holds a line no reader can read and no checkpoint vouches for one.
    Against what the checkpoint resumed from recorded of it (its `ledger` companion): a ledger cut short or changed
    inside that history, or lines that are no entries and that no `gap` marker lists (inside that history: kept by
    an older version; anywhere, on a start without a checkpoint), are refused in one line (LedgerError) before
    anything is written, unless `accept_gap`: then a `gap` marker lists every unreadable line. Lines that are no
    entries after that history (junk appended, a crash's NUL-filled line) are cut away with what follows them
    (`cut_unreadable_tail`: a `cut_tail` marker, one warning line). Returns the markers to append first."""
    path = run_dir / names.LEDGER_NAME
    recorded = sidecars.read_json(names.companion_path(info.path.parent, info.step, "ledger")) \
        if info is not None and info.path.parent == run_dir else None
    if not isinstance(recorded, dict) and info is not None:
        return []  # a checkpoint from before ledger records, or another directory's (--init-from)
    problem = ledger_problem(path, recorded, info.path.name) if recorded is not None else None
    vouched = recorded["bytes"] if recorded is not None and problem is None else None
    unlisted = unlisted_lines(path, vouched)
    if problem is None and unlisted:
        problem = (f"{path}: line {unlisted[0]} ({len(unlisted)} unreadable in all) is not a ledger entry, yet "
                   + (f"{info.path.name} vouches for it" if vouched is not None else "no `gap` marker lists it"))
    if problem is not None and not accept_gap:
        raise LedgerError(f"{problem}; restore {names.LEDGER_NAME} from a copy that holds those lines, or start "
                          "with --accept-ledger-gap to continue past the gap (recorded as a `gap` marker)")
    step = info.step if info is not None else 0
    markers = [cut] if vouched is not None and (cut := cut_unreadable_tail(run_dir, step, vouched)) else []
    if problem is not None:
        log.warning("%s; continuing past the gap (--accept-ledger-gap): a `gap` marker records it", problem)
        markers.append(marker("gap", step, reason=problem, recorded_bytes=recorded["bytes"] if recorded else 0,
                              unreadable_lines=unreadable_lines(path)))
    return markers


def cut_unreadable_tail(run_dir: Path, step: int, vouched: int) -> dict | None:
    """Cut the ledger back to the last entry before the first unreadable complete line after the `vouched` bytes
    (the previous process's superseded tail, which no checkpoint vouches for); the bytes cut are kept in
    quarantine/ first. Returns the `cut_tail` marker, or None when there was nothing to cut."""
    path = run_dir / names.LEDGER_NAME
    with regular.open_file(path) as f:
        f.seek(vouched)
        tail = f.read()
    at = unreadable_tail(tail)
    if at is None:
        return None
    cut = tail[at:]
    kept = run_dir / names.QUARANTINE_DIR / f"{names.LEDGER_NAME}.cut-at-{vouched + at}"
    kept.parent.mkdir(exist_ok=True)
    atomic.write_atomic(kept, cut)
    with regular.open_file(path, "rb+") as f:
        f.truncate(vouched + at)
        os.fsync(f.fileno())
    lines = cut.count(b"\n")
    log.warning("%s: cut %d bytes (%d lines, from byte %d) that are no ledger entries after what %s vouches for; "
                "kept in %s", path, len(cut), lines, vouched + at, names.checkpoint_name(step),
                kept.relative_to(run_dir))
    return marker("cut_tail", step, at=vouched + at, bytes=len(cut), lines=lines, kept=str(kept.relative_to(run_dir)))


def quarantine(run_dir: Path, path: Path) -> Path:
    """Move a checkpoint that failed validation, and its companions, into RUN_DIR/quarantine/ (a name taken
    there gets a numbered suffix); returns the directory."""
    step = names.step_of(path)
    dest = run_dir / names.QUARANTINE_DIR
    dest.mkdir(exist_ok=True)
    for f in [path, *names.companions(run_dir, step)]:
        target, k = dest / f.name, 1
        while target.exists():
            target, k = dest / f"{f.name}.{k}", k + 1
        os.rename(f, target)
    atomic.fsync_dir(dest)
    atomic.fsync_dir(run_dir)
    return dest


def restore_proxy(cfg: RunConfig, run_dir: Path, arms, info: ckpt.CheckpointInfo,
                  read_json: Callable[[Path], object] = sidecars.read_json) -> DataProxy:
    """The data proxy as of the checkpoint: its step_S.state.json, else .state.json if at S, else fresh.
    A state that is not this checkpoint's (garbage, another step's, another run's that does not fit) is passed
    over in one warning line: the bandit's state may be reset by contract (docs/formats.md), so a bad one never
    stops a start. `read_json`: how this rank reads a sidecar (on separate disks, rank 0 reads for it:
    control/parallel/sharing.py); every rank then decides the same."""
    step, passed = info.step, []
    for path in (sidecars.checkpoint_state_path(info.path.parent, step), run_dir / names.STATE_NAME):
        try:
            d = sidecars.opened(read_json(path), str(path))
            if d is None or (isinstance(d, dict) and d.get("step") != step and path.name == names.STATE_NAME):
                continue
            proxy, warnings = DataProxy.from_state(cfg, arms, d, step, str(path))
        except (BanditStateError, sidecars.SidecarError) as e:
            passed.append(str(e))
            continue
        if passed:
            log.warning("%s; the data proxy's state is restored from %s instead", "; ".join(passed), path.name)
        # a policy changed since (a pivot, new caps or floors): the fresh bandit of a new phase is expected
        new_phase = isinstance(d, dict) and proxy.phase == d.get("phase", -2) + 1 and proxy.phase_start == step
        for w in warnings:
            log.log(logging.INFO if new_phase else logging.WARNING, "%s: %s", path, w)
        return proxy
    if passed:
        log.warning("%s; the bandit starts fresh at step %d (data order after this point differs from the original "
                    "run's)", "; ".join(passed), step)
    elif step > 0:
        log.warning("no data-proxy state for step %d: the bandit starts fresh (data order after this point "
                    "differs from the original run's)", step)
    return DataProxy(cfg, arms, phase_start=step)
