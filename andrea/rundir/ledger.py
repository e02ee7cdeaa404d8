"""The loss ledger `.loss.json`: the run's append-only audit record (docs/formats.md#the-loss-ledger), its
writer and its reader. The training loop's feed into it (lines batched for the I/O thread, fsynced on a cadence)
is andrea/control/run/ledger_feed.py.

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
    mfu        model-FLOPs utilisation over the last max(log_every, 10) steps (andrea/control/observe/mfu.py); absent on a device
               without a known peak and for a process's first step

  marker (has an "event" key; always has "step" and "time"; each a row of rundir/markers.py's registry):
    start   a new run began at step 0            {"event": "start", "step": 0, "n_params": ..., "seed": ...,
                                                  "identity": {...} (control/run/identity.py), "run": ID}
            — "run": the run's id (32 hex digits, random), which every checkpoint of the run names (its ledger
              record, `seal`, and its checksum, rundir/checksum.py): the newest start marker's is the run's
            — or at step N from `--init-from step_N.bin` (a new run continuing that checkpoint's w, m and v:
              "step": N, "from": "/abs/step_N.bin", "phase": k), or from imported weights ("from", "weights_only")
    resume  training continues from a checkpoint {"event": "resume", "step": 40, "from": "step_000040.bin"}
            — both also say what `mfu` is measured against: {"flops_per_token": F, "peak_flops": P | null,
              "peak": "NVIDIA H200 bf16 989.4 TFLOP/s x 1" | "cpu: no peak to measure against (...)"}
            — step entries above 40 written before this marker are superseded by the entries after it
            (a `start` marker likewise supersedes every entry before it: the run began again from step 0)
    eval    validation loss                      {"event": "eval", "step": 500, "val_loss": ..., "arms": {...}}
    tasks   the task audit (eval.tasks, andrea/evals/tasks.py): multiple-choice accuracies of the live model
            {"event": "tasks", "step": 500, "acc": 0.31, "acc_norm": 0.33, "acc_norm_chars": 0.32,
             "examples": 1000, "tasks": "hellaswag_val.jsonl", "sha256": "..."}
    pivot   a new data policy (docs/operating.md)          {"event": "pivot", "step": ..., "phase": k, ...}
    branch  an audit branch starts here          {"event": "branch", "step": S, "parent": DIR}
    micro_batch  train.micro_batch_size = "auto" chose the rows per pass at the first step after step S (also
            written to run.toml)     {"event": "micro_batch", "step": S, "micro_batch_size": b, "rows": B/P,
                                      "out_of_memory_at": [B/P, ...]}
    torn_tail  a partial last line left by a crash was cut off at open {"event": "torn_tail", "bytes": k}
    cut_tail   a start resuming from the checkpoint of step S found complete lines that are no ledger entries
               (junk, a crash's NUL-filled line) after the bytes that checkpoint vouches for, and cut the file
               back to the last entry before the first of them (control/run/resume.py); the bytes cut are kept in
               quarantine/  {"event": "cut_tail", "step": S, "at": B, "bytes": k, "lines": n, "kept": "quarantine/..."}
    gap        the run continued past a ledger its checkpoint did not vouch for (`--accept-ledger-gap`)
               {"event": "gap", "step": S, "reason": "...", "recorded_bytes": B, "unreadable_lines": [n, ...]}
               — readers skip the unreadable lines it lists (and only those)
    incident   the divergence guard (control/guard/decisions.py) saw the run leave its basin at step T
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
    stall      the watchdog (control/observe/watchdog.py) of rank R (0 in one process) found a component busy without
               progress past its limit; the job exits 75 right after. S is the writer's header step; under
               torchrun rank 0 writes it for whichever rank hung (its stall note, control/parallel/stall_notes.py), and
               only while its I/O thread is alive
               {"event": "stall", "step": S, "component": "train" | "boundary" | "io", "seconds": 12.3,
                "limit": 10.0, "rank": R}
    plateau    no new best held-out loss in notify.plateau_evals evals (control/observe/plateau.py)
               {"event": "plateau", "step": S, "best_step": B, "best_loss": 2.91, "evals": n}
    quarantine, resume_below, replica_down, replica_back, rank_mismatch   the other incidents: a checkpoint moved
               to quarantine/, a start below the newest checkpoint, the replica's store failing and back, ranks whose
               weights differ at a checkpoint (fields: rundir/incidents.py)

Lifetime: the file is only ever appended to — never rewritten, archived or reset — with two exceptions made at
a start, both in what no checkpoint vouches for: a final line without its "\\n" (the trace of a crash in the
middle of an append) carries no complete entry and is truncated away, and a `torn_tail` marker records how many
bytes were cut; lines after the resumed checkpoint's record that are no entries are cut (`cut_tail`). Everything
a checkpoint vouches for is never touched.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from andrea.errors import UserError
from andrea.rundir import regular, sidecars
from andrea.rundir.ledger_seal import run_id, tail_step
from andrea.rundir.markers import RESETS



class LedgerError(UserError, ValueError):
    """A ledger that cannot be read; one line naming the file and the line."""


class LossLedger:
    """Appends lines with O_APPEND writes; `sync` makes them durable. Not thread-safe: one writer thread.

    A failed append (a full disk) is rolled back to the last complete line and its records are kept in a
    backlog that the next append retries first, so a disk that fills up and frees again leaves neither a torn
    line in the middle of the file nor a gap. `sync` raises while a backlog remains: a checkpoint is never
    committed ahead of the ledger lines it vouches for.

    A failed fsync is a loss, not a retry: after a write-back error the kernel may already have dropped the
    pages it could not write (and a later fsync then succeeds with nothing), so the bytes appended since the
    last good fsync are kept in memory and the next `sync` cuts the file back to that point and writes them
    again before it fsyncs. Until one succeeds, `sync` raises: no checkpoint commits on those lines.

    `seal()` is what a checkpoint records of the ledger (rundir/checksum.py's hash of every byte so far), so a
    start can tell a ledger cut short or changed inside its history from a crash's torn tail
    (rundir/ledger_seal.py `ledger_problem`), and the run's id (`run`: the newest `start` marker's, `run_id`),
    which binds the checkpoint to this run.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.torn_bytes = _cut_torn_tail(self.path)
        self._fd = regular.open_fd(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        self._hash = xxhash.xxh3_128()
        self.last_step: int | None = None
        with regular.open_file(self.path) as f:  # one read at open: the hash and the last step of what is there
            while piece := f.read(1 << 20):
                self._hash.update(piece)
        self.size = os.fstat(self._fd).st_size
        self.last_step = tail_step(self.path)
        self.run = run_id(self.path)  # the run's id: the newest start marker's (updated by an appended one)
        os.fsync(self._fd)  # what a previous process appended is durable from here on
        self._synced_size = self.size
        self._unsynced = bytearray()  # appended since the last good fsync: rewritten if an fsync fails
        self._lost = False
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
        steps = [r["step"] for r in self._backlog if "event" not in r]
        self.last_step = steps[-1] if steps else self.last_step
        for r in self._backlog:
            if r.get("event") == "start":
                self.run = r.get("run") if isinstance(r.get("run"), str) else None
        self._backlog = []
        self._hash.update(data)
        self._unsynced += data
        self.size = size + len(data)
        self._dirty = True

    @property
    def backlog(self) -> int:
        """Records not yet on disk because an append failed."""
        return len(self._backlog)

    def sync(self) -> None:
        if self._backlog:
            self.append([])
        if not self._dirty:
            return
        if self._lost:  # the last fsync failed: its pages may be gone; write the bytes again from memory
            os.ftruncate(self._fd, self._synced_size)
            view = memoryview(bytes(self._unsynced))
            while view:
                view = view[os.write(self._fd, view):]
        try:
            os.fsync(self._fd)
        except OSError:
            self._lost = True
            raise
        self._lost, self._dirty = False, False
        self._synced_size, self._unsynced = self.size, bytearray()

    def seal(self) -> dict[str, Any]:
        """What a checkpoint records of the ledger when it commits (after `sync`): its length, the hash of
        every byte of it, its last step entry, and the run's id (absent for a run started before ids). Format
        version 2: its writer seals it (rundir/sidecars.py's `seal`: a flipped digit of its length or last step
        would pass the checkpoint's checksum, which binds only the hash); a record without a version predates
        seals."""
        out = {"version": RECORD_VERSION, "bytes": self.size, "xxh3_128": self._hash.hexdigest(),
               "last_step": self.last_step}
        return out if self.run is None else {**out, "run": self.run}

    def record_bytes(self) -> bytes:
        """The bytes of the checkpoint's `step_NNNNNN.ledger.json`: `seal()`, sealed."""
        return sidecars.json_bytes(sidecars.seal(self.seal()))

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
    try:
        f = regular.open_file(path, "rb+")
    except FileNotFoundError:
        return 0
    with f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 0
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
    """Parse every line; a partial LAST line is reported, a bad line anywhere else is an error unless a later
    `gap` marker lists it (the run was continued past it with `--accept-ledger-gap`): every reader of the
    ledger then skips the same lines."""
    path = Path(path)
    out = LedgerContents()
    if not path.exists():
        return out
    lines = regular.read_bytes(path).split(b"\n")
    bad: list[tuple[int, str]] = []
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
            bad.append((i + 1, str(e)))
            continue
        if last:
            out.torn_tail = True  # parsed, but its "\n" never reached the disk
        out.entries.append(entry)
    accepted = {n for e in out.entries if e.get("event") == "gap" for n in e.get("unreadable_lines", [])}
    for number, why in bad:
        if number not in accepted:
            raise LedgerError(f"{path}: line {number} is not a ledger entry ({why}); the next `andrea train` cuts "
                              "it if it lies after what the newest checkpoint vouches for (kept in quarantine/), "
                              "else refuses, and `--accept-ledger-gap` records it as a gap") from None
    return out


def _entry(line: bytes) -> dict[str, Any] | None:
    """The ledger entry a complete line holds; None when it holds none (garbage, NUL bytes, not an object)."""
    try:
        entry = json.loads(line) if line else {"step": None}
    except ValueError:
        return None
    return entry if isinstance(entry, dict) and "step" in entry else None


def unreadable_lines(path: Path, upto: int | None = None) -> list[int]:
    """Line numbers (1-based) of the complete lines (within the first `upto` bytes) that are not ledger entries."""
    data = regular.read_bytes(path) if path.exists() else b""
    lines = data[:upto].split(b"\n")[:-1]
    return [i + 1 for i, line in enumerate(lines) if _entry(line) is None]


def unlisted_lines(path: Path, upto: int | None = None) -> list[int]:
    """`unreadable_lines` that no `gap` marker lists: the lines every reader of the ledger refuses."""
    bad = unreadable_lines(path, upto)
    if not bad:
        return []
    listed = {n for e in readable_entries(path) if e.get("event") == "gap" for n in e.get("unreadable_lines", [])}
    return [n for n in bad if n not in listed]


def readable_entries(path: Path) -> list[dict[str, Any]]:
    """Every complete line that is a ledger entry, the others skipped: for a reader that wants the run's markers
    (its `start` identity, its replica's owner) whatever else the file holds. Other readers use `read_ledger`."""
    lines = regular.read_bytes(path).split(b"\n")[:-1] if path.exists() else []
    return [e for e in map(_entry, lines) if e is not None]


def unreadable_tail(tail: bytes) -> int | None:
    """Where, in `tail` (the bytes after what the newest checkpoint vouches for: the previous process's superseded
    lines), the first complete line that is not a ledger entry starts; None when every complete line is one."""
    offset = 0
    for line in tail.split(b"\n")[:-1]:
        if _entry(line) is None:
            return offset
        offset += len(line) + 1
    return None


def history(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The effective step entries: a start/resume/branch/rollback marker at step S supersedes earlier entries above S.

    (A `start` after entries means a run that died before its first checkpoint began again from step 0.)
    """
    kept: list[dict[str, Any]] = []
    for e in entries:
        if e.get("event") in RESETS:
            kept = [k for k in kept if k["step"] <= e["step"]]
        elif "event" not in e:
            kept.append(e)
    return kept


def live_markers(entries: list[dict[str, Any]], event: str) -> list[dict[str, Any]]:
    """The `event` markers (eval, tasks) that a later start/resume/branch/rollback did not supersede (`history`'s
    rule), without their "event" key: each is offered to `history` as if it were a step entry, among the markers."""
    return history([{k: v for k, v in e.items() if k != "event"} if e["event"] == event else e
                    for e in entries if "event" in e])


def last_step(entries: list[dict[str, Any]]) -> int | None:
    steps = [e["step"] for e in entries if "event" not in e]
    return steps[-1] if steps else None


EMA_BETA = 0.99  # the loss EMA of published claims: ~100-step memory, the checkpoint cadence
RECORD_VERSION = 2  # step_NNNNNN.ledger.json: sealed (none: from before seals)


def ema(values: list[float], beta: float = EMA_BETA) -> list[float]:
    """Bias-corrected exponential moving average (as Adam's moments): no drag from a zero or first value."""
    out, avg = [], 0.0
    for t, v in enumerate(values, start=1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta ** t))
    return out
