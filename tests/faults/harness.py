"""Shared machinery of the fault suite: the invariants checked after every fault, and the one report table.

Invariants (what a fault may never do to a run directory):
    every file named `step_NNNNNN.bin` passes deep validation (andrea/rundir/checkpoint.py), whatever was interrupted;
    `.loss.json` parses, with at most a torn LAST line (a crash mid-append);
    no step entry at or before the newest committed checkpoint is missing from `history()`, and none is doubled.
`REPORT` collects what every test saw; tests/faults/conftest.py prints it as one table at the end of the session.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from andrea.rundir import checkpoint as ckpt
from andrea.rundir.names import LEDGER_NAME
from andrea.rundir.ledger import LedgerError, history, read_ledger

TINY_PRESET = "andrea-tiny"


def tiny_n_params() -> int:
    from andrea.config import load as configload
    from andrea.model.arch import layout_for
    from andrea.model.gpt import n_params
    return n_params(layout_for(configload.load(preset=TINY_PRESET).model))


def digest_diff(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return ([f"removed {k}" for k in before if k not in after] + [f"added {k}" for k in after if k not in before]
            + [f"changed {k}" for k in before if k in after and before[k] != after[k]])


def checkpoint_problems(run_dir: Path, n: int) -> list[str]:
    """One line per file named like a checkpoint that fails deep validation (torn, truncated, garbage)."""
    problems = []
    for _, path in ckpt.list_checkpoints(run_dir):
        try:
            ckpt.validate(path, n, deep=True)
        except ckpt.CheckpointError as e:
            problems.append(str(e))
    return problems


def newest_committed(run_dir: Path) -> int:
    """Header step of the newest checkpoint file (0 if none): the step a resume must start from."""
    found = ckpt.list_checkpoints(run_dir)
    return found[-1][0] if found else 0


def stale_tmp(run_dir: Path) -> list[str]:
    return sorted(p.name for p in run_dir.glob("*.tmp"))


@dataclass
class LedgerCheck:
    torn_tail: bool = False
    broken: str | None = None  # a bad line that is not the last one (never allowed)
    lost: list[int] = field(default_factory=list)  # steps 1..S missing from history()
    doubled: list[int] = field(default_factory=list)  # steps present twice in history()
    entries: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.broken is None and not self.lost and not self.doubled


def check_ledger(run_dir: Path, committed: int) -> LedgerCheck:
    out = LedgerCheck()
    try:
        contents = read_ledger(run_dir / LEDGER_NAME)
    except LedgerError as e:
        out.broken = str(e)
        return out
    out.torn_tail, out.entries = contents.torn_tail, contents.entries
    steps = [e["step"] for e in history(contents.entries)]
    seen = Counter(steps)
    out.doubled = sorted(s for s, k in seen.items() if k > 1)
    out.lost = [s for s in range(1, committed + 1) if s not in seen]
    return out


def step_entries(entries: list[dict]) -> list[dict]:
    return [e for e in entries if "event" not in e]


def last_error_line(stderr: str) -> str:
    lines = [l for l in stderr.strip().splitlines() if l.strip()]
    return lines[-1] if lines else ""


def first_line_with(text: str, needle: str) -> str:
    return next((l for l in text.splitlines() if needle in l), "")


def pause(proc: subprocess.Popen, seconds: float) -> None:
    """Sleep up to `seconds`, returning early if the process exits (no busy polling)."""
    try:
        proc.wait(timeout=max(0.0, seconds))
    except subprocess.TimeoutExpired:
        pass


def has_name(directory: Path, prefix: str, suffix: str, exclude: frozenset = frozenset()) -> bool:
    """Whether a file named prefix…suffix (not in `exclude`) is in `directory`: one cheap listdir."""
    try:
        return any(n.startswith(prefix) and n.endswith(suffix) and n not in exclude for n in os.listdir(directory))
    except FileNotFoundError:
        return False


def wait_for_path(condition, proc: subprocess.Popen, timeout: float, interval: float = 0.002) -> bool:
    """Poll `condition()` until it holds (True) or the process exits / the timeout passes (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return bool(condition())
        time.sleep(interval)
    return False


def sigkill(proc: subprocess.Popen) -> bool:
    """SIGKILL if still running; True when the signal hit a live process."""
    if proc.poll() is not None:
        return False
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


@dataclass
class BadInput:
    name: str
    outcome: str  # "refused" (non-zero exit, one line) or "fallback: ..." (documented recovery)
    rc: int
    message: str


@dataclass
class Report:
    """Everything the session saw, printed once as the fault table (tests/faults/conftest.py)."""
    trials: int = 0
    kills: Counter = field(default_factory=Counter)  # by kill moment
    torn_checkpoints: list[str] = field(default_factory=list)
    torn_ledger_tails: int = 0
    broken_ledger_lines: list[str] = field(default_factory=list)
    lost_ledger_lines: int = 0
    doubled_ledger_lines: int = 0
    crashes: list[str] = field(default_factory=list)
    resumes_ok: int = 0
    bit_identical: list[str] = field(default_factory=list)
    bad_inputs: list[BadInput] = field(default_factory=list)
    notes: list[tuple[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, area: str, text: str) -> None:
        with self.lock:
            self.notes.append((area, text))

    def bad_input(self, name: str, outcome: str, rc: int, message: str) -> None:
        with self.lock:
            self.bad_inputs.append(BadInput(name, outcome, rc, message.strip()))

    def empty(self) -> bool:
        return not (self.trials or self.bad_inputs or self.notes)

    def lines(self) -> list[str]:
        kills = sum(self.kills.values())
        modes = ", ".join(f"{k} {v}" for k, v in sorted(self.kills.items()))
        rows = [
            ("kill trials (trainer processes started)", str(self.trials)),
            ("SIGKILLs delivered to a live trainer", f"{kills}" + (f"  ({modes})" if modes else "")),
            ("resumes that started from the newest checkpoint", str(self.resumes_ok)),
            ("checkpoints found torn or invalid", str(len(self.torn_checkpoints))),
            ("ledger: torn last lines (tolerated)", str(self.torn_ledger_tails)),
            ("ledger: broken lines before the last", str(len(self.broken_ledger_lines))),
            ("ledger lines lost at/before the last committed ckpt", str(self.lost_ledger_lines)),
            ("ledger lines doubled in history()", str(self.doubled_ledger_lines)),
            ("crashes (unexpected exit or failed resume)", str(len(self.crashes))),
            ("final bytes equal to a never-killed run", "; ".join(self.bit_identical) or "-"),
        ]
        width = max(len(k) for k, _ in rows)
        out = [f"{k:<{width}}  {v}" for k, v in rows]
        for what, items in (("torn checkpoint", self.torn_checkpoints), ("broken ledger", self.broken_ledger_lines),
                            ("crash", self.crashes)):
            out += [f"  {what}: {x[:300]}" for x in items[:10]]
        if self.bad_inputs:
            out.append("")
            out.append(f"bad inputs tried: {len(self.bad_inputs)}")
            w = max(len(b.name) for b in self.bad_inputs)
            for b in self.bad_inputs:
                out.append(f"  {b.name:<{w}}  exit {b.rc:<4} {b.outcome}: {b.message[:220]}")
        if self.notes:
            out.append("")
            for area, text in self.notes:
                out.append(f"  [{area}] {text[:300]}")
        return out


REPORT = Report()
