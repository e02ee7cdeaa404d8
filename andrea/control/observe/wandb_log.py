"""Weights & Biases for a run (`log.wandb = true`, the `andrea[wandb]` extra): the ledger's settled history, one
W&B run per andrea run across every restart.

W&B's history only moves forward: a row at a step at or below the newest one logged is dropped. andrea's ledger
does go back — a resume supersedes the entries after its checkpoint, the guard's rollback those after its
known-good point (rundir/ledger.py `history`). So W&B gets only what can no longer be superseded: `Rows` holds
the ledger's lines and releases a step once the *settled* step has passed it — the newest checkpoint that is
committed and, with the guard on, confirmed good (no resume or rollback can go below it; the runtime says which
step that is at each boundary). W&B's history is then `ledger.history`, a checkpoint interval or so behind the
ledger, and never shows a step twice or a rolled-back step as real. One exception is said in a warning: a start
that resumes below what W&B was sent (a newer checkpoint failed verification, control/run/resume.py, or went missing);
W&B keeps those steps, and the ledger stays the record.

A row is a step: its entry's scalars, named as in TensorBoard (control/observe/scalars.py), the markers at that step
(eval, tasks), the checkpoint's `checkpoint/stall_s`, `checkpoint/commit_s` and `data/share/<arm>`, and the run's
events as `event/<kind>` = the marker's step (start, resume, pivot, incident, rollback, recovered, gap, stall,
guard_stop, micro_batch, branch; `event/rollback_from`, `event/incident_loss`), each in the row of the next
step entry after it (the first step a resume or rollback trains; an incident's own step is superseded). The config is the run's (`run.toml`).

Files: `RUN_DIR/.wandb.json` {"id": ..., "logged_through": S} — the W&B run's id (created at the first start, kept
for every later one) and the newest step logged; written atomically after each batch of rows is handed to W&B.
A restart backfills from `.loss.json` everything after S. A record of the wrong shape never stops a start: one
warning line, and a new W&B run when its id is unusable, else the same run offered the whole ledger again
(`from_record`). W&B's own files go under RUN_DIR/wandb/ (offline mode:
one `offline-run-*` directory per process, all with the run's id; `wandb sync` uploads them in start order).

Threads: one daemon thread owns the W&B SDK; the event loop only puts on its queue. W&B absent (the extra not
installed), unreachable or failing costs no step: one warning line, the rows stay queued and the next settled
step tries again, after a back-off. Rows wait in memory only up to MAX_PENDING steps: past that (W&B unreachable
for days) this process stops feeding W&B, in one line, and the next start sends the rest from the ledger
(`logged_through` never passed them). The end of a run waits for W&B at most `log.wandb_timeout_s`. Under data
parallelism only rank 0 (the ledger's writer) opens it.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import secrets
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from andrea.config.outputs import LogConfig
from andrea.control.observe.scalars import RESETS, LedgerScalars
from andrea.rundir import atomic, checkpoint as ckpt, regular
from andrea.rundir.ledger import read_ledger
from andrea.rundir.names import LEDGER_NAME, QUARANTINE_DIR, WANDB_DIR, WANDB_STATE_NAME

log = logging.getLogger("andrea.wandb")

RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # W&B run ids (andrea makes 8 hex digits): no / \\ # ? % :

EVENTS = ("start", "resume", "branch", "pivot", "incident", "rollback", "recovered", "gap", "stall", "guard_stop",
          "micro_batch")


class Rows:
    """The W&B rows not yet logged, by step; pure (no SDK, no files).

    `add(lines)` takes ledger lines in ledger order (`live` False for the backfill from the file at a start);
    `put(step, values)` values from outside the ledger (a checkpoint's); `settle(step, final)` releases the rows
    W&B may now show, in step order. A row at the settled step itself waits for a line past it (its eval, its
    checkpoint's values come after its entry), unless `final`: the process ends, nothing more comes at it.
    """

    def __init__(self, logged_through: int, log_every: int):
        self.logged = logged_through  # W&B holds every step up to here
        self.rows: dict[int, dict[str, Any]] = {}
        self.carry: dict[str, Any] = {}  # values for a step already logged: they go with the next row
        self.scalars = LedgerScalars(log_every)
        self.rewound_below: tuple[int, int] | None = None  # (logged, step): a live reset went below what W&B
        self.rewound_said = False                            # was sent (said once)

    def add(self, lines: list[dict[str, Any]], live: bool = True) -> None:
        for e in lines:
            step, event = e["step"], e.get("event")
            values = dict(self.scalars.of(e))
            if event in RESETS:
                self.rows = {s: row for s, row in self.rows.items() if s <= step}
                if live and step < self.logged and not self.rewound_said:
                    self.rewound_below, self.rewound_said = (self.logged, step), True
            if event is None:
                if step > self.logged:
                    self.rows.setdefault(step, {}).update(values | self.carry)
                    self.carry = {}
                continue
            if not live and step <= self.logged:
                continue  # the backfill: W&B has it
            if event in EVENTS:  # an event goes with the next step entry (one after a rollback or resume)
                values[f"event/{event}"] = step
                if event == "rollback":
                    values["event/rollback_from"] = e["from"]
                elif event == "incident" and isinstance(e.get("loss"), (int, float)):
                    values["event/incident_loss"] = e["loss"]
                self.carry.update(values)
            elif values:  # a measurement at its step (eval, tasks)
                self.put(step, values)

    def put(self, step: int, values: dict[str, Any]) -> None:
        if step in self.rows:
            self.rows[step].update(values)
        else:  # no entry of its own yet (logged, or a marker ahead of its step): the next row carries it
            self.carry.update(values)

    def settle(self, step: int, final: bool = False) -> list[tuple[int, dict[str, Any]]]:
        newest = max(self.rows, default=step)
        through = step if final or newest > step else step - 1
        out = [(s, self.rows.pop(s)) for s in sorted(self.rows) if s <= through]
        if out:
            self.logged = out[-1][0]
        return out


def read_state(run_dir: Path) -> Any:
    """`.wandb.json` as parsed JSON ({} when absent); anything unreadable is one warning line and {}."""
    try:
        return json.loads(regular.read_text(run_dir / WANDB_STATE_NAME))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # a damaged record: a new W&B run rather than no W&B at all
        log.warning("%s: unreadable (%s): a new W&B run is started", run_dir / WANDB_STATE_NAME, e)
        return {}


def newest_checkpoint(run_dir: Path) -> int:
    """The newest checkpoint step the run has written that is still on disk (set aside ones included), -1 if none:
    W&B is only ever sent steps a checkpoint settled, so `logged_through` cannot be past it."""
    return max((s for d in (run_dir, run_dir / QUARANTINE_DIR) for s, _ in ckpt.list_checkpoints(d)), default=-1)


def from_record(raw: Any, newest: int, where: str) -> tuple[str | None, int, str | None]:
    """(W&B run id or None for a new run, logged_through, the one warning line or None) from `.wandb.json`.

    The record only ever says which W&B run this is and how far it got, so a record of the wrong shape never
    stops training: an id that is no W&B run id starts a new W&B run (the old one, if any, keeps its charts);
    a usable id with a `logged_through` that is no step keeps that run and offers it the whole ledger again
    (W&B drops the steps it holds: its history only moves forward). A `logged_through` past the run's newest
    checkpoint (`newest`, newest_checkpoint) cannot be true: it is taken as that step."""
    if not isinstance(raw, dict):
        return None, -1, (f"{where}: a JSON {type(raw).__name__}, not the W&B record "
                          '{"id": ..., "logged_through": STEP}: a new W&B run is started')
    run_id, through = raw.get("id"), raw.get("logged_through", -1)
    if run_id is not None and not (isinstance(run_id, str) and RUN_ID.fullmatch(run_id)):
        return None, -1, f"{where}: id {run_id!r} is no W&B run id: a new W&B run is started"
    if run_id is None:
        return None, -1, None
    if isinstance(through, bool) or not isinstance(through, int) or through < -1:
        return run_id, -1, (f"{where}: logged_through {through!r} is no step: W&B run {run_id} goes on and is "
                            "offered every step of the ledger (it keeps the ones it has)")
    if through > newest:
        return run_id, newest, (f"{where}: logged_through {through} is past the run's newest checkpoint, step "
                                f"{newest} (W&B is only sent steps a checkpoint has settled): taken as {newest}")
    return run_id, through, None


def rewound_warning(logged: int, resumed_from: int) -> str:
    """What a start that resumed below what W&B was sent means for W&B (said once)."""
    return (f"this start resumed from step {resumed_from}, below step {logged} that W&B was sent "
            f"({WANDB_STATE_NAME}): W&B keeps the steps it has, and steps {resumed_from + 1}..{logged} of this "
            "timeline will not reach it (its history only moves forward); the ledger is the record")


class WandbLog:
    """The W&B side of a run: `add_records`, `add_checkpoint`, `on_commit`, `add_replica` and `settle` only queue;
    the thread logs. `close` ends the W&B run within `log.wandb_timeout_s`."""

    RETRY_S = (30.0, 60.0, 120.0, 300.0, 600.0)  # back-off between failed attempts to reach W&B
    MAX_PENDING = 100_000  # rows held while W&B cannot be reached (~0.5 kB each): then the next start sends them

    def __init__(self, cfg: LogConfig, run_dir: Path, run_config: dict[str, Any], log_every: int):
        self.cfg, self.run_dir, self.run_config = cfg, run_dir, run_config
        # The backfill: every ledger line on disk now, before this process appends its own (they come live).
        self.id, logged_through, warning = from_record(read_state(run_dir), newest_checkpoint(run_dir),
                                                       str(run_dir / WANDB_STATE_NAME))
        if warning:
            log.warning("%s", warning)
        self.rows = Rows(logged_through, log_every)
        self.rows.add(read_ledger(run_dir / LEDGER_NAME).entries, live=False)
        self.run = None
        self.failures, self.retry_at = 0, 0.0
        self.disabled = False
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name="andrea-wandb", daemon=True)
        self.thread.start()

    # --- called on the event loop (or the replicator's thread): never blocks ------------------------------------
    def add_records(self, lines: list[dict[str, Any]]) -> None:
        self.queue.put((self.rows.add, lines))

    def add_checkpoint(self, step: int, state: dict[str, Any], stall_s: float) -> None:
        values = {f"data/share/{arm}": share for arm, share in (state.get("shares") or {}).items()}
        self.queue.put((self.rows.put, step, values | {"checkpoint/stall_s": stall_s}))

    def on_commit(self, fut) -> None:
        """Done-callback of a commit future (a control/commit/writer.py CommitResult)."""
        if not fut.cancelled() and fut.exception() is None and fut.result().error is None:
            result = fut.result()
            self.queue.put((self.rows.put, result.step, {"checkpoint/commit_s": result.seconds}))

    def add_replica(self, step: int, lag_steps: int, lag_s: float) -> None:
        self.queue.put((self.rows.put, step, {"replica/lag_steps": lag_steps, "replica/lag_s": lag_s}))

    def settle(self, step: int, final: bool = False) -> None:
        """Nothing at or below `step` can be superseded any more (module docstring)."""
        self.queue.put((self._settle, step, final))

    def close(self, settled: int | None) -> None:
        """Log what `settled` releases and end the W&B run, waiting at most log.wandb_timeout_s."""
        if settled is not None:
            self.settle(settled, final=True)
        self.queue.put(None)
        self.thread.join(self.cfg.wandb_timeout_s)
        if self.thread.is_alive():
            log.warning("W&B did not finish within log.wandb_timeout_s=%g s; what it has not sent stays under %s "
                        "(`wandb sync`) and the next start sends the rest", self.cfg.wandb_timeout_s,
                        self.run_dir / WANDB_DIR)

    # --- the andrea-wandb thread -------------------------------------------------------------------------
    def _work(self) -> None:
        while (job := self.queue.get()) is not None:
            if self.disabled:
                continue  # nothing is held for a W&B this process will not reach
            fn, *args = job
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001  (a view of the ledger must never take the run down)
                log.error("W&B: %s (the ledger is unaffected)", e)
        if self.run is not None:
            try:
                self.run.finish()
            except Exception as e:  # noqa: BLE001
                log.warning("W&B: finishing the run failed: %s", e)

    def _settle(self, step: int, final: bool) -> None:
        if self.rows.rewound_below is not None:
            log.warning("W&B: %s", rewound_warning(*self.rows.rewound_below))
            self.rows.rewound_below = None  # said once
        if self.run is None and len(self.rows.rows) > self.MAX_PENDING:
            self._stop(f"W&B has not been reachable for {len(self.rows.rows)} steps: this process stops holding rows "
                       f"for it; the next start sends W&B every step after {self.rows.logged} from the ledger")
            return
        if (time.monotonic() < self.retry_at and not final) or not self._ready():
            return
        rows = self.rows.settle(step, final)
        if not rows:
            return
        for s, values in rows:
            self.run.log(values, step=s)
        atomic.write_atomic(self.run_dir / WANDB_STATE_NAME,
                            json.dumps({"id": self.id, "logged_through": self.rows.logged}).encode())

    def _stop(self, why: str) -> None:
        """No more W&B in this process: said once, and nothing held for it any more."""
        log.warning("%s", why)
        self.disabled = True
        self.rows.rows.clear()
        self.rows.carry.clear()

    def _ready(self) -> bool:
        """The W&B run, started or resumed on first use; False (and a retry later) when W&B cannot be reached."""
        if self.run is not None:
            return True
        try:
            import wandb
        except ImportError:
            self._stop("log.wandb=true but the W&B SDK is not installed: `pip install -e '.[wandb]'` from andrea's "
                       "clone; training goes on without W&B")
            return False
        try:
            if self.id is None:
                self.id = secrets.token_hex(4)  # W&B's run ids: [a-z0-9], 8 characters
                atomic.write_atomic(self.run_dir / WANDB_STATE_NAME,
                                    json.dumps({"id": self.id, "logged_through": self.rows.logged}).encode())
            (self.run_dir / WANDB_DIR).mkdir(exist_ok=True)
            c = self.cfg
            self.run = wandb.init(**init_settings(c, os.environ),
                                  name=c.wandb_name or self.run_dir.resolve().name, id=self.id, resume="allow",
                                  dir=str(self.run_dir), config=self.run_config,
                                  settings=wandb.Settings(silent=True, init_timeout=c.wandb_timeout_s))
            self.run.config.update(self.run_config, allow_val_change=True)  # a resume's --set, a pivot's policy
            self.failures = 0
            return True
        except Exception as e:  # noqa: BLE001  (no network, a bad key: the run goes on, the rows wait)
            wait = self.RETRY_S[min(self.failures, len(self.RETRY_S) - 1)]
            self.failures += 1
            self.retry_at = time.monotonic() + wait
            log.warning("W&B could not start the run (%s): training goes on, the rows wait; next try in %g s",
                        str(e).splitlines()[0] if str(e) else type(e).__name__, wait)
            return False


def init_settings(cfg: LogConfig, environ: Mapping[str, str]) -> dict[str, str | None]:
    """W&B's project, entity and mode: run.toml's `log.wandb_*` where it names one, else W&B's own environment
    (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE), else andrea's defaults (project "andrea", the API key's entity,
    online). The precedence is W&B's own: a variable the user exported is not overridden by a key left empty."""
    return {"project": cfg.wandb_project or environ.get("WANDB_PROJECT") or "andrea",
            "entity": cfg.wandb_entity or environ.get("WANDB_ENTITY") or None,
            "mode": cfg.wandb_mode or environ.get("WANDB_MODE") or "online"}


def open_log(cfg: LogConfig, run_dir: Path, run_config: dict[str, Any], log_every: int) -> WandbLog | None:
    """The run's W&B log, or None when `log.wandb` is off."""
    return WandbLog(cfg, run_dir, run_config, log_every) if cfg.wandb else None
