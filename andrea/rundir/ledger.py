"""The loss ledger `.loss.json`: the run's append-only audit record (docs/formats.md#the-loss-ledger), its
writer and its reader. The training loop's feed into it (lines batched for the I/O thread, fsynced on a cadence)
is andrea/control/ledger.py.

Format: JSON Lines — one JSON object per line, UTF-8, each line ending in "\\n". Two kinds of line:

  step entry (one per optimizer update, no "event" key):
    {"step": 41, "loss": 3.21, "lr": 0.0006, "grad_norm": 0.83, "tokens": 83968, "time": 1764430000.12,
     "phase": 0}
    step       header step after the update (the step a checkpoint of this state carries)
    loss       mean training loss of the update's batch (fp32)
    lr         learning rate used by the update
    grad_norm  global gradient norm before clipping
    tokens     training tokens seen up to and including this update
    time       Unix time at which the control plane recorded the entry
    phase      policy phase (0 until the first pivot)

  marker (has an "event" key; always has "step" and "time"):
    start   a new run began at step 0            {"event": "start", "step": 0, "n_params": ..., "seed": ...}
    resume  training continues from a checkpoint {"event": "resume", "step": 40, "from": "step_000040.bin"}
            — step entries above 40 written before this marker are superseded by the entries after it
            (a `start` marker likewise supersedes every entry before it: the run began again from step 0)
    eval    validation loss                      {"event": "eval", "step": 500, "val_loss": ..., "arms": {...}}
    pivot   a new data policy (docs/operating.md)          {"event": "pivot", "step": ..., "phase": k, ...}
    branch  an audit branch starts here          {"event": "branch", "step": S, "parent": DIR}
    micro_batch  train.micro_batch_size = "auto" chose the rows per pass at the first step after step S (also
            written to run.toml)     {"event": "micro_batch", "step": S, "micro_batch_size": b, "rows": B/P,
                                      "out_of_memory_at": [B/P, ...]}
    torn_tail  a partial last line left by a crash was cut off at open {"event": "torn_tail", "bytes": k}
    incident   the divergence guard (control/guard.py) saw the run leave its basin at step T
               {"event": "incident", "step": T, "reason": "loss 9.3 above its band 7.5 (3 of the last 5 steps
                anomalous)", "loss": 9.3, "grad_norm": 3.0, "attempt": k}   (a non-finite value as a string)
    rollback   the guard went back to its known-good checkpoint and continues from there
               {"event": "rollback", "step": G, "from": T, "checkpoint": "step_000040.bin" | "initial state",
                "attempt": k, "remedy": "skip_data" | "skip_data+lr_scale", "data_offset": o, "lr_scale": s}
               — like `resume`, it supersedes the step entries above G written before it; from here batch t
               draws the data of stream key t + o and the learning rate is lr_at(t) · s (the step entries'
               `lr` is the rate actually used)
    recovered  a checkpoint past the series' incident was confirmed good: the next incident starts over at
               attempt 1                          {"event": "recovered", "step": C}
    guard_stop the divergence persisted after guard.max_attempts rollbacks: the run stopped non-zero
               {"event": "guard_stop", "step": T, "attempts": k, "resume_from": "step_000040.bin" | null}

Lifetime: the file is only ever appended to — never rewritten, archived or reset — with one exception made at
open: a final line without its "\\n" (the trace of a crash in the middle of an append) carries no complete
entry and is truncated away, and a `torn_tail` marker records how many bytes were cut. Everything before
the last "\\n" is never touched.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any



class LedgerError(ValueError):
    """A ledger that cannot be read; one line naming the file and the line."""


class LossLedger:
    """Appends lines with O_APPEND writes; `sync` makes them durable. Not thread-safe: one writer thread.

    A failed append (a full disk) is rolled back to the last complete line and its records are kept in a
    backlog that the next append retries first, so a disk that fills up and frees again leaves neither a torn
    line in the middle of the file nor a gap. `sync` raises while a backlog remains: a checkpoint is never
    committed ahead of the ledger lines it vouches for.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.torn_bytes = _cut_torn_tail(self.path)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._dirty = False
        self._backlog: list[dict[str, Any]] = []
        if self.torn_bytes:
            self.append([marker("torn_tail", step=-1, bytes=self.torn_bytes)])

    def append(self, records: list[dict[str, Any]]) -> None:
        self._backlog.extend(records)
        if not self._backlog:
            return
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self._backlog).encode()
        size = os.fstat(self._fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view):]
        except OSError:
            os.ftruncate(self._fd, size)
            raise
        self._backlog = []
        self._dirty = True

    @property
    def backlog(self) -> int:
        """Records not yet on disk because an append failed."""
        return len(self._backlog)

    def sync(self) -> None:
        if self._backlog:
            self.append([])
        if self._dirty:
            os.fsync(self._fd)
            self._dirty = False

    def close(self) -> None:
        if self._fd >= 0:
            try:
                self.sync()
            finally:
                os.close(self._fd)
                self._fd = -1


def marker(event: str, step: int, **fields: Any) -> dict[str, Any]:
    return {"event": event, "step": step, "time": round(time.time(), 3), **fields}


def _cut_torn_tail(path: Path) -> int:
    if not path.exists():
        return 0
    size = path.stat().st_size
    if size == 0:
        return 0
    with open(path, "rb+") as f:
        tail_from = max(0, size - (1 << 20))
        f.seek(tail_from)
        tail = f.read()
        if tail.endswith(b"\n"):
            return 0
        last_nl = tail.rfind(b"\n")
        keep = tail_from + last_nl + 1 if last_nl >= 0 else (0 if tail_from == 0 else None)
        if keep is None:
            raise LedgerError(f"{path}: last line is longer than 1 MiB and has no end; refusing to touch it")
        f.truncate(keep)
        f.flush()
        os.fsync(f.fileno())
        return size - keep


@dataclass
class LedgerContents:
    entries: list[dict[str, Any]] = field(default_factory=list)  # every parsed line, markers included
    torn_tail: bool = False  # the last line is partial (tolerated: a crash mid-append)


def read_ledger(path: str | Path) -> LedgerContents:
    """Parse every line; a partial LAST line is reported, a bad line anywhere else is an error."""
    path = Path(path)
    out = LedgerContents()
    if not path.exists():
        return out
    data = path.read_bytes()
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        if not line:
            continue
        last = i == len(lines) - 1  # no trailing "\n" after it
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict) or "step" not in entry:
                raise ValueError("not an entry object")
        except ValueError as e:
            if last:
                out.torn_tail = True
                break
            raise LedgerError(f"{path}: line {i + 1} is not a ledger entry ({e})") from None
        if last:
            out.torn_tail = True  # parsed, but its "\n" never reached the disk
        out.entries.append(entry)
    return out


def history(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The effective step entries: a start/resume/branch/rollback marker at step S supersedes earlier entries above S.

    (A `start` after entries means a run that died before its first checkpoint began again from step 0.)
    """
    kept: list[dict[str, Any]] = []
    for e in entries:
        if e.get("event") in ("start", "resume", "branch", "rollback"):
            kept = [k for k in kept if k["step"] <= e["step"]]
        elif "event" not in e:
            kept.append(e)
    return kept


def last_step(entries: list[dict[str, Any]]) -> int | None:
    steps = [e["step"] for e in entries if "event" not in e]
    return steps[-1] if steps else None


EMA_BETA = 0.99  # the loss EMA of published claims: ~100-step memory, the checkpoint cadence


def ema(values: list[float], beta: float = EMA_BETA) -> list[float]:
    """Bias-corrected exponential moving average (as Adam's moments): no drag from a zero or first value."""
    out, avg = [], 0.0
    for t, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** t))
    return out
