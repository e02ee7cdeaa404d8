"""`python -m andrea ctl RUN_DIR checkpoint|stop|status`: operators' and scripts' handle on a running trainer.

Reads `train.pid` and the `train.lock` flock (control/runlock.py) to find the live trainer, the tail of
`.loss.json` and the checkpoints to report state; sends SIGUSR1 (checkpoint) or SIGTERM (stop).
With --timeout, `checkpoint` waits for a checkpoint newer than the one present when it was sent and `stop`
waits for the process to exit.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from andrea import checkpoint as ckpt
from andrea.control.ledger import LEDGER_NAME
from andrea.control.runlock import is_locked, read_pid


def last_ledger_step(run_dir: Path) -> int | None:
    """The step of the newest complete step entry, read from the file's tail only."""
    path = run_dir / LEDGER_NAME
    if not path.exists():
        return None
    with open(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - (64 << 10)))
        lines = f.read().split(b"\n")[:-1]  # the part after the last "\n" is incomplete
    for line in reversed(lines):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and "event" not in entry and "step" in entry:
            return entry["step"]
    return None


def status(run_dir: Path) -> dict:
    running = is_locked(run_dir)
    found = ckpt.list_checkpoints(run_dir)
    return {"run_dir": str(run_dir), "running": running, "pid": read_pid(run_dir) if running else None,
            "step": last_ledger_step(run_dir), "newest_checkpoint": found[-1][1].name if found else None,
            "checkpoints": [p.name for _, p in found]}


def main(run_dir: Path, action: str, timeout: float = 0.0) -> int:
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run directory")
    st = status(run_dir)
    if action == "status":
        print(json.dumps(st, indent=1))
        return 0
    if not st["running"] or st["pid"] is None:
        raise ProcessLookupError(f"{run_dir}: no trainer is running on this run directory")
    before = st["newest_checkpoint"]
    os.kill(st["pid"], signal.SIGUSR1 if action == "checkpoint" else signal.SIGTERM)
    print(f"sent {'SIGUSR1' if action == 'checkpoint' else 'SIGTERM'} to pid {st['pid']}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = status(run_dir)
        if action == "stop" and not now["running"]:
            print(f"stopped; newest checkpoint {now['newest_checkpoint']}")
            return 0
        if action == "checkpoint" and now["newest_checkpoint"] != before:
            print(f"checkpoint {now['newest_checkpoint']}")
            return 0
        time.sleep(0.2)
    return 0 if timeout == 0 else 1
