"""Whether a start has anything to train: a run already at (or past) its target step says so and trains nothing.

The target is `train.steps`, which run.toml keeps like every other key (an earlier `--steps` included), so a plain
restart resumes towards the same step. `note` is the decision, a pure function over the steps; `reached` reads
the run directory's newest checkpoint (validated whole: a damaged one is left to the resume, which falls back);
`agreed` is the same reading under torchrun, rank 0's, so that every rank trains or none does. Reads checkpoints;
writes nothing.
"""

from __future__ import annotations

from pathlib import Path

from andrea.rundir import checkpoint as ckpt
from andrea.rundir.runlock import is_locked


def note(run_dir: Path, step: int, target: int, from_flag: bool) -> str | None:
    """The one line a start prints when the run's newest checkpoint `step` is at or past `target` (None: there is
    something to train). `from_flag`: this start's own --steps set the target (else run.toml or a preset did)."""
    if step < target:
        return None
    where = "--steps" if from_flag else "train.steps, kept in run.toml from an earlier --steps or --set"
    at = f"at its target step {target}" if step == target else f"at step {step}, past its target step {target}"
    return (f"{run_dir}: nothing to train: already {at} ({where}); `--steps N` with N > {step} trains further, "
            f"and run.toml keeps N")


def reached(run_dir: Path, target: int) -> int | None:
    """The newest checkpoint's step when it is at or past `target` and valid (checksum included); else None. A
    run another trainer holds is left to the start's lock, which refuses it naming that trainer."""
    found = ckpt.list_checkpoints(run_dir)
    if not found or found[-1][0] < target or is_locked(run_dir):
        return None
    try:
        return ckpt.validate(found[-1][1], deep=True).step
    except ckpt.CheckpointError:  # the resume skips it and trains from an older one
        return None


def agreed(run_dir: Path, target: int, world) -> int | None:
    """`reached` as rank 0 reads it, on every rank of `world` (control/parallel/distributed.py's World, its process
    group joined): on separate disks only rank 0's directory holds the checkpoints, and a rank that decided alone
    would end while its peers wait for it in a collective. One process: `reached`."""
    return world.broadcast(reached(run_dir, target) if world.leader else None)
