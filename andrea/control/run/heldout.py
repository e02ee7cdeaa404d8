"""The run's held-out history: the validation loss at each step an eval ran, in the run's effective timeline.

Owned by the run (control/run/runtime.py builds it at the start, control/run/boundary.py records each eval and
cuts it back at a rollback), read by whatever judges the run by its held-out loss: `checkpoint.keep_best`
(rundir/retention.py, through `losses`, on the I/O and replica threads) and the plateau notice
(control/observe/plateau.py). Seeded at a start from the ledger's `eval` markers that no later start, resume,
branch or rollback superseded (rundir/ledger.py `live_markers`: the ledger's effective-history rule), up to the
step the process starts from; the evals of a timeline a rollback abandoned are never in it.

`losses()` returns a mapping that is never changed afterwards (each change builds a new one), so another thread
reads it without a lock. Reads the ledger once (`seeded`); writes nothing.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from andrea.control.run.observers import Observer
from andrea.rundir.ledger import live_markers


def eval_losses(lines: list[dict], upto: int) -> dict[int, float]:
    """{step: val_loss} of the live `eval` markers among the ledger's `lines` at steps <= `upto` (pure)."""
    out = {}
    for e in live_markers(lines, "eval"):
        loss = e.get("val_loss")
        if isinstance(e.get("step"), int) and e["step"] <= upto and isinstance(loss, (int, float)):
            out[e["step"]] = float(loss)
    return out


def read_markers(path: Path) -> list[dict]:
    """The ledger's complete marker lines (those with an "event" key; step entries are not parsed: a long run's
    ledger holds millions of them), in order; unreadable lines skipped."""
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().split(b"\n")[:-1]:
        if b'"event"' in line:
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if isinstance(e, dict) and "event" in e and "step" in e:
                out.append(e)
    return out


class HeldOut(Observer):
    """The validation losses by step (plain floats), in the order the evals ran; told of each eval and rollback by
    the boundary (control/run/observers.py)."""

    def __init__(self, losses: Mapping[int, float] | None = None):
        self._losses: Mapping[int, float] = MappingProxyType(dict(sorted((losses or {}).items())))

    @classmethod
    def seeded(cls, ledger_path: Path, upto: int) -> HeldOut:
        """From the ledger's effective evals up to the step a process starts from."""
        return cls(eval_losses(read_markers(ledger_path), upto))

    def losses(self) -> Mapping[int, float]:
        return self._losses

    def record(self, step: int, loss: float) -> None:
        """An eval at `step` (a non-finite loss is recorded too: it is never a best)."""
        self._losses = MappingProxyType({**{s: v for s, v in self._losses.items() if s < step}, step: float(loss)})

    def cut(self, step: int) -> None:
        """The run went back to `step` (a rollback): the evals above it belong to an abandoned timeline."""
        self._losses = MappingProxyType({s: v for s, v in self._losses.items() if s <= step})

    def best(self) -> tuple[int, float] | None:
        """(step, loss) of the lowest finite loss (the earlier of equals), None before any."""
        finite = [(v, s) for s, v in self._losses.items() if math.isfinite(v)]
        return None if not finite else (min(finite)[1], min(finite)[0])

    def evals_since_best(self) -> int:
        """How many evals ran after the best one (all of them when none was finite)."""
        b = self.best()
        return len(self._losses) if b is None else sum(1 for s in self._losses if s > b[0])

    def on_eval(self, step: int, val_loss: float) -> None:
        self.record(step, val_loss)

    def on_rollback(self, step: int) -> None:
        self.cut(step)
