"""The chaos run's ground (bench/chaos.py): the prepared data, the run's target step, the full disk's filesystem.

- `read_ledger`, `newest_checkpoint`, `dir_state`: what the supervisor and the report read of a run directory.
- `prepare_template`: `andrea prepare` once; every run directory of the chaos copies its tokenizer and data
  (tests/runs.py `seed_data`), so no start pays for the preparation.
- `calibrate`: a short fault-free run of the same command (3 checkpoints' worth of steps) times the steps, and the
  target is the step that rate reaches after one `--every` per fault and one more.
- `flip_mantissa_bit`: the bit flip of the `bitflip` fault.
- `reference_run`: the same command on a perfect machine (one process, no fault), in a fresh directory.
- `torch_import_seconds`: what `import torch` alone costs on this machine now (every start pays it).
- `mount_disk`: a tmpfs in this process's own mount namespace (bench/chaos.py re-runs itself under `unshare -m`;
  the mount dies with the namespace), sized for the data, `checkpoint.keep_last` + 5 checkpoints (the spare, a
  temporary file, the guard's known-good one, a quarantined one) and 16 MiB of ledger and sidecars.
Writes only under the chaos's work directory.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

from andrea.config.keepers import GuardConfig
from andrea.config.outputs import CheckpointConfig
from andrea.control.guard.decisions import most_tentative
from bench import chaos_plan as plan
from tests.notices import Inbox
from tests.runs import andrea, seed_data
from tests.s3server import BUCKET, S3Server

# The chaos run keeps the defaults: checkpoint.keep_last's, and guard.confirm_steps's (its tentative checkpoints
# stay on disk beside keep_last's)
KEEP_LAST, CONFIRM_STEPS = CheckpointConfig().keep_last, GuardConfig().confirm_steps


def ledger_lines(run: Path) -> list[str]:
    """The ledger's complete lines (a torn last line, a crash's trace, is skipped); [] if there is none."""
    try:
        text = (run / ".loss.json").read_text()
    except FileNotFoundError:
        return []
    return [line for line in text.split("\n")[:-1] if line]


def read_ledger(run: Path) -> list[dict]:
    return [json.loads(line) for line in ledger_lines(run)]


def newest_checkpoint(run: Path) -> int | None:
    from andrea.rundir.checkpoint import list_checkpoints
    found = list_checkpoints(run) if run.is_dir() else []
    return max((s for s, _ in found), default=None)


def dir_state(run: Path) -> plan.DirState:
    marks = ("run.toml", ".loss.json")
    gone = not run.is_dir() or (not any((run / m).exists() for m in marks) and newest_checkpoint(run) is None)
    return plan.DirState(gone, (run / "restore.partial").exists(), None if gone else newest_checkpoint(run))


def prepare_template(preset: str, where: Path) -> Path:
    r = andrea("prepare", "--preset", preset, "--run-dir", str(where), timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"andrea prepare failed:\n{r.stderr[-3000:]}")
    return where


def calibrate(args, work: Path, template: Path) -> int:
    """The target step: what the fault-free rate reaches in (faults + 1) x --every seconds, a multiple of the
    checkpoint cadence."""
    run = seed_data(template, work / "calibration")
    k = args.checkpoint_every
    t = time.time()
    r = andrea("train", "--preset", args.preset, "--run-dir", str(run), "--device", "cpu", "--steps", str(3 * k),
               "--checkpoint-every", str(k), "--set", "sample.every=1000000", "--set", "train.eval_every=1000000",
               timeout=3600)
    if r.returncode != 0:
        raise SystemExit(f"the calibration run failed:\n{r.stderr[-3000:]}")
    entries = [json.loads(line) for line in (run / ".loss.json").read_text().splitlines() if line]
    rate = plan.steady_rate(entries)
    args.calibration = {"steps_per_s": rate, "seconds": time.time() - t}
    return max(4 * k, math.ceil(rate * args.every * (len(args.faults) + 1) / k) * k)


def mount_disk(where: Path, template: Path, args) -> Path:
    info = json.loads(andrea("info", "--preset", args.preset).stdout)
    seeded = sum(p.stat().st_size for p in template.rglob("*") if p.is_file())
    # keep_last's, the guard's known-good and tentative ones (beyond keep_last: control/guard/decisions.py thins them to
    # a few per confirm_steps), the one being written, and a margin
    kept = KEEP_LAST + 1 + most_tentative(CONFIRM_STEPS, args.checkpoint_every) + 1 + 3
    size = seeded + kept * int(info["checkpoint_bytes"]) + (16 << 20)
    where.mkdir(parents=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k", "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"cannot mount a tmpfs for the full disk: {r.stderr.strip()}")
    return where


def flip_mantissa_bit(path: Path) -> str:
    """Flip the lowest mantissa bit of the middle weight: a value still finite and near its old self."""
    from andrea.rundir.checkpoint import HEADER
    with open(path, "r+b") as f:
        _, n = HEADER.unpack(f.read(HEADER.size))
        offset = HEADER.size + 4 * (n // 2)  # little-endian float32: the first byte holds mantissa bits 0-7
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))
        f.flush()
        os.fsync(f.fileno())
    return f"{path.name} byte {offset} bit 0"


def reference_run(args, work: Path, template: Path, server: S3Server, poison: int | None, flags) -> dict:
    """The same command, on a perfect machine: one process, no fault (the poisoned step, if any, included)."""
    ref = seed_data(template, work / "reference")
    inbox = Inbox()
    try:
        argv = ["train", "--preset", args.preset, "--run-dir", str(ref), "--device", "cpu", "--steps",
                str(args.steps), "--checkpoint-every", str(args.checkpoint_every),
                *flags(args, f"s3://{BUCKET}/reference", inbox)]
        extra = {**server.env(), **({"ANDREA_TEST_POISON_STEPS": str(poison)} if poison else {})}
        t = time.time()
        r = andrea(*argv, timeout=24 * 3600, extra_env=extra)
        wall = time.time() - t
    finally:
        inbox.close()
    if r.returncode != 0:
        raise SystemExit(f"the fault-free run failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return {"dir": ref, "wall": wall, "ledger": read_ledger(ref), "newest": newest_checkpoint(ref)}


def torch_import_seconds(tries: int) -> float | None:
    """The median wall seconds of `python -c "import torch"` (what every start pays first), or None."""
    times = []
    for _ in range(tries):
        t = time.time()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        times.append(time.time() - t)
    return sorted(times)[len(times) // 2] if times else None
