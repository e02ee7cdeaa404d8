"""The file side of the divergence guard's decisions (control/guard/decisions.py decides; this carries them out).

Reads and writes, in the run directory:
    step_NNNNNN.guard.json   the guard's state as of that checkpoint (format: control/guard/decisions.py), written
                             atomically beside each checkpoint and rewritten on the known-good checkpoint at a
                             rollback, so a run stopped in the middle of an incident resumes with the decisions
                             already taken; deleted with its checkpoint by the writer (`step_NNNNNN.*.json`).
                             Sealed (`companion_bytes`: rundir/sidecars.py's `seal`): a bit flipped in it, even one
                             that leaves a valid data offset, makes it unreadable at the next start, never used
    step_NNNNNN.bin          (deletes) the checkpoints after the known-good one at a rollback: they belong to
                             the abandoned timeline, and a restart must not resume from them
Reads the known-good state's payload: a checkpoint, imported --init-from weights, or the seeded initialisation.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from andrea.config.schema import RunConfig
from andrea.control.guard.decisions import Guard, GuardStateError, named_checkpoints
from andrea.rundir import atomic, checkpoint as ckpt, names, sidecars


def companion_path(run_dir: Path, step: int) -> Path:
    return names.companion_path(run_dir, step, "guard")


def companion_bytes(state: dict) -> bytes:
    """The bytes of the companion of a guard state (`Guard.to_state`): sealed with its checksum."""
    return sidecars.json_bytes(sidecars.seal(state))


def load_guard(cfg: RunConfig, info: ckpt.CheckpointInfo | None, run_dir: Path,
               init_from: str | None = None,
               read_json: Callable[[Path], object] = sidecars.read_json,
               exists: Callable[[Path], bool] = Path.exists,
               ledger_remedy: Callable[[], dict | None] = lambda: None) -> tuple[Guard, str | None]:
    """The guard as of the checkpoint resumed from (its companion), else one whose known-good point is that
    checkpoint (a run from before the guard, a branch, --init-from) or the initial state; and a warning.
    A companion whose known-good checkpoint is not in the run directory (a restore from a replica that no longer
    held it, a hand deletion, retention after a newer checkpoint was found corrupt, a branch of an older checkpoint)
    cannot be rolled back to: the oldest tentative checkpoint still there before the one resumed from, else that
    one, becomes the known-good point (decisions.py's `repoint`), said in one line. The rest
    of the companion is kept: its data offset and lr scale are the trajectory's (the data each later step reads, its
    learning rate), not the pointer's, so losing the pointer changes neither; tentative checkpoints that are gone
    are dropped (none of them may become the good point).
    A companion that is missing or unreadable (its seal broken, which every reader of its checkpoint refuses
    first: rundir/checkpoint.py): the guard starts afresh from the checkpoint resumed from, with the data offset and lr scale the ledger's rollback markers
    put in force at its step (`ledger_remedy()`: decisions.py's `remedy_in_force`, None for none).
    `read_json`, `exists`: how this rank reads the companion and sees a checkpoint (on separate disks, rank 0
    answers: control/parallel/sharing.py)."""
    warmup = cfg.train.warmup_steps  # the gradient norm's grace (control/guard/decisions.py)
    if info is None:
        return Guard(cfg.guard, init_from=init_from, warmup_steps=warmup), None
    path = companion_path(info.path.parent, info.step)
    name = info.path.name if info.path.parent == run_dir else str(info.path.resolve())
    try:
        d = sidecars.opened(read_json(path), str(path))
        if d is not None:
            guard = Guard.from_state(cfg.guard, d, info.step, str(path), warmup_steps=warmup)
            gone = {s for s in named_checkpoints(d)
                    if s != info.step and not exists(run_dir / names.checkpoint_name(s))}
            guard.tentative = [t for t in guard.tentative if t["step"] not in gone]
            if guard.good["step"] in gone and guard.good["path"] is not None:
                lost = names.checkpoint_name(guard.good["step"])
                guard.repoint(info.step, name)
                return guard, (f"{path}: its known-good checkpoint {lost} is not in {run_dir} (a rollback could "
                               f"not read it); the guard's known-good point is now {guard.good['path']}, and the "
                               f"run keeps the data offset {guard.remedy['data_offset']} and lr scale "
                               f"{guard.remedy['lr_scale']:g} it recorded")
            return guard, None
    except (sidecars.SidecarError, GuardStateError) as e:
        remedy = ledger_remedy()
        return _afresh(cfg, info.step, name, remedy), f"{e}; the guard starts afresh from {name} ({_kept(remedy)})"
    remedy = ledger_remedy()
    return _afresh(cfg, info.step, name, remedy), (
        f"{path}: missing; the guard starts afresh from {name} ({_kept(remedy)})" if remedy is not None else None)


def _afresh(cfg: RunConfig, step: int, name: str, remedy: dict | None) -> Guard:
    """A guard whose known-good point is the checkpoint resumed from, with the ledger's data offset and lr scale
    (`remedy`; None: none recorded)."""
    guard = Guard(cfg.guard, good_step=step, good_path=name, warmup_steps=cfg.train.warmup_steps)
    if remedy is not None:
        guard.remedy = {**guard.remedy, **remedy}
        guard.good["remedy"] = dict(guard.remedy)
    return guard


def _kept(remedy: dict | None) -> str:
    if remedy is None:
        return "data offset 0 and lr scale 1: the ledger records no rollback before it"
    return (f"keeping the data offset {remedy['data_offset']} and lr scale {remedy['lr_scale']:g} its rollback "
            "markers in the ledger put in force")


def good_payload(guard: Guard, run_dir: Path, cfg: RunConfig, trainer) -> torch.Tensor:
    """[w | m | v] (3n,) fp32 of the known-good point: its checkpoint, else the initial state."""
    good = guard.good
    if good["path"] is not None:
        path = Path(good["path"]) if Path(good["path"]).is_absolute() else run_dir / good["path"]
        _, payload = ckpt.read_payload(path, trainer.n)
        return torch.from_numpy(payload)
    payload = torch.zeros(3 * trainer.n, dtype=torch.float32)
    if good.get("init_from"):  # weights imported by --init-from: re-read them, m = v = 0 (andrea/model/init_from.py)
        from andrea.model.init_from import read_weights
        weights = read_weights(Path(good["init_from"]), trainer.layout, cfg.model.arch, cfg.model.qk_scale)
        payload[:trainer.n] = torch.from_numpy(np.asarray(weights))
    else:
        from andrea.model.arch import init_weights
        payload[:trainer.n] = init_weights(trainer.layout, cfg.model, cfg.train.seed)
    return payload


def in_run_dir(guard: Guard, run_dir: Path) -> bool:
    """Whether the known-good point is a checkpoint in this run directory (else it must be written there)."""
    path = guard.good["path"]
    return path is not None and not Path(path).is_absolute() and (run_dir / path).exists()


def drop_after(run_dir: Path, step: int) -> list[str]:
    """Delete the checkpoints above `step` with their companions; return their names."""
    dropped = []
    for s, path in ckpt.list_checkpoints(run_dir):
        if s > step:
            path.unlink(missing_ok=True)
            for companion in names.companions(run_dir, s):
                companion.unlink(missing_ok=True)
            dropped.append(path.name)
    if dropped:
        atomic.fsync_dir(run_dir)
    return dropped


def write_companion(run_dir: Path, step: int, state: dict) -> None:
    atomic.write_atomic(companion_path(run_dir, step), companion_bytes(state))
