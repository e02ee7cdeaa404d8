"""The replicator: each committed checkpoint and the ledger copied to the run's replica on its own thread.

Off the hot path. One `andrea-replica` thread (niced: on a busy CPU the training threads go first) reads committed
files (never the staging buffers) and talks to the store (control/replica/remote.py); the training loop only calls
`notify()` when a commit lands, which sets a flag. A step never waits for the store: a slow store delays the
replica, not training. A store that is down or refusing is said in ONE warning line when it starts failing (and
again only when the problem changes), retried with exponential backoff, and told once more when it is back;
each of the two is also a ledger marker and a notice (`replica_down`, `replica_back`: rundir/incidents.py), handed
to the event loop through `on_incident`. An outage is the store's, not the process's: one a previous process
ended with (a `replica_down` open on the record, `plan.open_outage`) is this process's from its start, so its
first pass that reaches the store writes the `replica_back` that closes it.
Passes start at most every MIN_INTERVAL seconds (commits landing faster coalesce: a bounded request rate, whatever
the cadence), and each sends the newest checkpoint and the keep_every milestones the replica lacks. What to send,
drop and say is decided in control/replica/plan.py (plain functions over plain data and an injected clock).

The abandoned timeline. A guard rollback to step G (control/run/boundary.py) and a start that resumes from step S
below the replica's newest (a newer checkpoint failed verification, was lost, or was not restored) abandon every
step after G or S: `supersede(step)` has the next pass unpublish the replica's checkpoints above it
(`superseded`) before it uploads anything, so a `restore` never brings back a checkpoint the ledger superseded,
and a step trained again is uploaded again instead of being taken for the abandoned copy of the same name.
A process that ended between its rollback and its next pass leaves such a copy behind; the first pass of every
process therefore compares the `.sum.json` of each published checkpoint the run directory also holds with the
local one (a few hundred bytes each) and unpublishes the copies that differ (`Replicator._stale`).

One pass (`sync`), in order: the owner check and claim of the replica (control/replica/owner.py's `replica.json`, before
anything else is written), the abandoned timeline's checkpoints unpublished, run.toml, tokenizer.json, the
sidecars, archive/, quarantine/ and data/ (a file there already at its size is never sent again), the checkpoints
of the plan (each: `.bin` verified on the way and read back, companions, the ledger, then its `.sum.json`), the
ledger, the replica's retention (the run's one policy, rundir/retention.py, over its published checkpoints), and the objects of
checkpoints never published (an upload a kill interrupted). Then `RUN_DIR/.replica.json` (`andrea status`) and
TensorBoard's `replica/lag_steps` and `replica/lag_s`.

Retention with a replica: `protected()` names the newest replicated checkpoint and the one being uploaded; they
are one of the parts the run's retention spares (`start_for`: `retention.spare("replica", ...)`, beside the
divergence guard's points and keep_best), so the newest checkpoint the replica holds is never deleted locally
before a newer one is replicated.

At a stop `finish(timeout)` asks for one last pass and waits for it at most `checkpoint.replica_wait` seconds, then
says in one line what the replica holds (`plan.stop_line`); an upload still in flight then is abandoned (the store
publishes nothing half-written) and the next start finishes it.
Test hook (andrea/testhooks.py): `ANDREA_TEST_REPLICA_BACKOFF=<seconds>`: the first retry's delay (1 s; doubling up to 60 s). Never set
in production.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from andrea import testhooks
from andrea.control.guard.decisions import named_checkpoints
from andrea.control.replica.admit import claimant, earlier_starts, record_of, vouched_run
from andrea.control.replica.plan import Health, open_outage, stop_line, superseded, upload_plan
from andrea.rundir import checkpoint as ckpt, checksum, regular
from andrea.control.replica import owner, remote as rep
from andrea.rundir.ledger import readable_entries
from andrea.rundir.names import LEDGER_NAME, checkpoint_name, companion_path
from andrea.rundir.retention import Retention

log = logging.getLogger("andrea.control.replica")
MIN_INTERVAL = 2.0  # seconds between the starts of two passes: commits landing faster coalesce into one pass
NICE = 10  # the replica thread's niceness (Linux: per thread), above the trainer's own


def _read_json(path: Path):
    try:
        return json.loads(regular.read_bytes(path))
    except (OSError, ValueError):
        return None


# --- the thread --------------------------------------------------------------------------------------------
@dataclass
class Position:
    """What the replica holds, as this process last saw it."""
    steps: list[int] = field(default_factory=list)
    ledger_size: int | None = None
    sent: dict[str, tuple[int, int]] = field(default_factory=dict)  # key -> (size, mtime_ns) uploaded
    claimed: bool = False
    inherited: bool = False  # the record's open outage, if any, taken as this process's (once)
    compared: bool = False  # the published checkpoints' checksums compared with the run directory's (once)


class Replicator:
    def __init__(self, uri: str, run_dir: Path, *, retention: Retention,
                 clock: Callable[[], float] = time.monotonic, on_lag: Callable[[int, int, float], None] | None = None,
                 base_delay: float = 1.0, max_delay: float = 60.0, replica: rep.Replica | None = None,
                 min_interval: float = MIN_INTERVAL, on_incident: Callable[[str, dict], None] | None = None):
        self.uri, self.run_dir = uri, run_dir
        self.on_incident = on_incident  # (kind, detail): replica_down / replica_back, from this thread
        self.retention = retention  # the run's one policy (rundir/retention.py), the local writer's too
        self.clock, self.on_lag = clock, on_lag
        self.health = Health(base_delay, max_delay)
        self.replica = replica
        self.pos = Position()
        self.uploading: int | None = None
        self._cv = threading.Condition()
        self._asked = 1  # passes asked for so far (a commit landed, the stop): the first one at start
        self._served = 0  # the last ask a successful pass started after: caught up when it equals _asked
        self._stopping = False
        self._floor: int | None = None  # supersede(): the replica's checkpoints above it are abandoned
        self._floor_asked = 0  # supersede() calls so far: a pass clears the floor only if none came during it
        self.min_interval = min_interval
        self._last_start: float | None = None
        self.thread = threading.Thread(target=self._run, name="andrea-replica", daemon=True)

    @property
    def newest(self) -> int | None:
        return self.pos.steps[-1] if self.pos.steps else None

    def start(self) -> Replicator:
        self.thread.start()
        return self

    def notify(self, *_) -> None:
        """A commit landed (or anything worth a pass): never blocks (a done-callback of the commit future)."""
        with self._cv:
            self._asked += 1
            self._cv.notify_all()

    def supersede(self, step: int) -> None:
        """The run went back to `step` (a rollback, a resume): the next pass unpublishes the replica's checkpoints
        above it before it uploads anything. Never blocks."""
        with self._cv:
            self._floor = step if self._floor is None else min(self._floor, step)
            self._floor_asked += 1
            self._asked += 1
            self._cv.notify_all()

    def protected(self) -> list[int]:
        """Steps local retention must keep: the newest replicated one and the one being uploaded."""
        return [s for s in (self.newest, self.uploading) if s is not None]

    def finish(self, timeout: float) -> bool:
        """One last pass, started after everything committed so far, waited for at most `timeout` seconds; True
        when it succeeded (the replica holds the newest checkpoint)."""
        with self._cv:
            self._asked += 1
            ask = self._asked
            self._stopping = True
            self._cv.notify_all()
            began = self.clock()
            deadline = began + timeout
            while self._served < ask and self.thread.is_alive():
                left = deadline - self.clock()
                if left <= 0:
                    break
                self._cv.wait(min(left, 0.5))
            caught_up = self._served >= ask
        local = [s for s, _ in ckpt.list_checkpoints(self.run_dir)]
        line = stop_line(self.uri, caught_up, self.newest, local[-1] if local else None, self.clock() - began,
                         self.health.error is not None)
        log.log(logging.INFO if caught_up else logging.WARNING, "%s", line)
        return caught_up

    def _run(self) -> None:
        tid = threading.get_native_id()
        try:  # this thread alone, niced: under CPU contention the training threads go first
            os.setpriority(os.PRIO_PROCESS, tid, NICE)
        except (AttributeError, OSError):
            pass
        try:  # its name for the OS too (Linux, 15 bytes): `top -H` and /proc show what the CPU is spent on
            with open(f"/proc/self/task/{tid}/comm", "w") as f:
                f.write(self.thread.name[:15])
        except OSError:
            pass
        while True:
            with self._cv:
                while self._served >= self._asked or not self._due():
                    if self._stopping and self._served >= self._asked:
                        return
                    wait = None if self._served >= self._asked else self._next() - self.clock()
                    self._cv.wait(None if wait is None else max(0.01, wait))
                ask = self._asked
                self._last_start = self.clock()
            ok = self.pass_once()
            with self._cv:
                if ok:
                    self._served = max(self._served, ask)
                self._cv.notify_all()

    def _next(self) -> float:
        """When the next pass may start: after the backoff of a failure, and (unless stopping) `min_interval` after
        the previous pass started."""
        spaced = 0.0 if self._stopping or self._last_start is None else self._last_start + self.min_interval
        return max(self.health.next_try, spaced)

    def _due(self) -> bool:
        return self.clock() >= self._next()

    def pass_once(self) -> bool:
        """One pass; store errors are recorded and said, never raised (the run goes on)."""
        try:
            self.sync()
        except Exception as e:  # noqa: BLE001  (the store, a bug or a local read error: said, retried, never the
            self.uploading = None  # run's end)
            error = e if isinstance(e, rep.ReplicaError) else \
                rep.ReplicaError(f"replica {self.uri}: {type(e).__name__}: {e}")
            line = self.health.failed(error, self.clock())
            if line:
                log.warning("%s", line)
            if line and self.health.record(error.kind):  # not twice on the record: an outage left open is this one
                self._incident("replica_down", problem=error.kind, error=str(error))
            if isinstance(e, rep.ReplicaError):
                self._status()
            return False  # asked again when due (Health.next_try)
        down_s = self.health.outage_s(self.clock())
        line = self.health.succeeded()
        if line:
            log.warning("replica %s: %s (step %s)", self.uri, line, self.newest)
            self._incident("replica_back", down_s=round(down_s, 1), replica_step=self.newest)
        self._status()
        return True

    def _incident(self, kind: str, **detail) -> None:
        if self.on_incident is not None:
            self.on_incident(kind, {"uri": self.uri, **detail})

    # --- one pass ------------------------------------------------------------------------------------------
    def sync(self) -> None:
        """One pass, its phases in the order the module docstring gives (each reads what the previous left)."""
        if self.replica is None:
            self.replica = rep.Replica(self.uri)
        if not self._claim():
            return  # no start marker yet: nothing of this run to claim a replica with
        with self._cv:
            floor, floor_asked = self._floor, self._floor_asked
        listing = self.replica.listing()
        self.pos.steps = rep.published_steps(listing)
        self.pos.ledger_size = listing.get(LEDGER_NAME)
        if floor is not None:
            self._drop_abandoned(floor, listing)
        with self._cv:
            if self._floor_asked == floor_asked:  # no rollback since this pass read the floor: done with it
                self._floor = None
        if not self.pos.compared:
            self._drop_stale(listing)
        self._files(listing)
        self._upload_checkpoints()
        self._ledger()
        self._retain(listing)

    def _claim(self) -> bool:
        """The owner check and claim of the replica, once a process (before anything else is written), after an
        outage that a previous process left open on the record is taken as this one's (`open_outage`: the first
        pass that succeeds then closes it with replica_back); False before the run has a start marker."""
        if not self.pos.claimed:
            entries = readable_entries(self.run_dir / LEDGER_NAME)
            record = record_of(entries, vouched_run(self.run_dir))
            if record is None:
                return False
            if not self.pos.inherited:
                self.health.inherit(open_outage(entries, self.uri), self.clock(), time.time())
                self.pos.inherited = True
            owner.claim(self.replica, record, earlier_starts(entries), claimant(self.run_dir))
            self.pos.claimed = True
        return True

    def _drop_abandoned(self, floor: int, listing: dict[str, int]) -> None:
        """The run went back to `floor`: the replica's checkpoints above it unpublished, and the guard companion a
        rollback rewrote at `floor` sent again."""
        for step in superseded(self.pos.steps, floor):
            log.info("replica %s: step %d belongs to an abandoned timeline (the run went back to %d): unpublished",
                     self.uri, step, floor)
            self._unpublish(step, listing)
        if floor in self.pos.steps:
            for key in rep.companion_keys(floor, run_dir=self.run_dir):
                self.replica.put_file(key, self.run_dir / key)

    def _drop_stale(self, listing: dict[str, int]) -> None:
        """The first pass of a process: published copies that differ from the run directory's, unpublished."""
        for step in self._stale(self.pos.steps):
            log.info("replica %s: step %d is not the run directory's checkpoint of that step (an abandoned "
                     "timeline's copy): unpublished", self.uri, step)
            self._unpublish(step, listing)
        self.pos.compared = True

    def _upload_checkpoints(self) -> None:
        """The checkpoints of the plan, newest first (`upload_plan`); one retention took meanwhile is skipped."""
        local = [s for s, _ in ckpt.list_checkpoints(self.run_dir)]
        spared = self.retention.spared() | set(self._guard_good(local))
        for step in upload_plan(local, self.pos.steps, self.retention.policy, spared, self.retention.scores()):
            self.uploading = step
            if not (self.run_dir / checkpoint_name(step)).exists():
                continue  # retention took it meanwhile
            log.info("replica %s: uploading step %d", self.uri, step)
            try:
                rep.upload_checkpoint(self.replica, self.run_dir, step, self._ledger)
            except FileNotFoundError:
                continue  # released by retention while it was read: a newer one is there
            self.pos.steps = sorted(set(self.pos.steps) | {step})
            self.uploading = None
            log.info("replica %s: step %d published", self.uri, step)
        self.uploading = None

    def _retain(self, listing: dict[str, int]) -> None:
        """The replica's retention (the run's one policy, sparing what the local retention spares and the known-good
        checkpoint the newest guard state names), then the objects of checkpoints never published (an upload a
        kill interrupted: never restored)."""
        guard = self._guard_good([s for s, _ in ckpt.list_checkpoints(self.run_dir)])
        for step in self.retention.victims(self.pos.steps, also=guard):
            self._unpublish(step, listing)
        for step in rep.unpublished_steps(listing, self.pos.steps):
            rep.remove_checkpoint(self.replica, step, listing)

    def _guard_good(self, local: list[int]) -> list[int]:
        """The known-good checkpoint the newest local checkpoint's guard state names (control/guard/decisions.py), if any."""
        state = _read_json(companion_path(self.run_dir, local[-1], "guard")) if local else None
        good = state.get("good") if isinstance(state, dict) else None
        return [s for s in named_checkpoints({"good": good}) if s in local]

    def _unpublish(self, step: int, listing: dict[str, int]) -> None:
        """Remove a published checkpoint from the replica (its `.sum.json` first) and from what this process knows."""
        rep.remove_checkpoint(self.replica, step, listing)
        self.pos.steps = [s for s in self.pos.steps if s != step]  # a new list: protected() reads it on the I/O thread

    def _stale(self, steps: list[int]) -> list[int]:
        """Published steps whose `.sum.json` differs from the run directory's for the same step."""
        stale = []
        for step in steps:
            local = checksum.sum_path(self.run_dir / checkpoint_name(step))
            try:
                mine = regular.read_bytes(local)
            except FileNotFoundError:
                continue  # retention took it: nothing here to differ from
            if self.replica.get(local.name) != mine:
                stale.append(step)
        return stale

    def _ledger(self) -> None:
        self.pos.ledger_size = rep.upload_ledger(self.replica, self.run_dir, self.pos.ledger_size)

    def _files(self, listing: dict[str, int]) -> None:
        """run.toml, tokenizer.json, sidecars, archive/, data/: what changed since this process sent it; a data
        or archive file the replica holds at its size is not sent again."""
        for key in rep.run_files(self.run_dir):
            path = self.run_dir / key
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            signature = (st.st_size, st.st_mtime_ns)
            if self.pos.sent.get(key) == signature:
                continue
            if "/" in key and listing.get(key) == st.st_size:  # data/ and archive/ files are written once
                self.pos.sent[key] = signature
                continue
            self.replica.put_file(key, path)
            self.pos.sent[key] = signature

    def _status(self) -> None:
        local = [(s, p) for s, p in ckpt.list_checkpoints(self.run_dir)]
        newest_local = local[-1][0] if local else None
        behind = [p for s, p in local if self.newest is None or s > self.newest]
        try:
            lag_s = max(0.0, time.time() - min(p.stat().st_mtime for p in behind)) if behind else 0.0
        except FileNotFoundError:
            lag_s = 0.0
        lag_steps = (newest_local or 0) - (self.newest or 0) if behind else 0
        try:
            rep.write_status(self.run_dir, {"uri": self.uri, "step": self.newest, "local_step": newest_local,
                                            "lag_steps": lag_steps, "lag_seconds": round(lag_s, 1),
                                            "error": self.health.error})
        except OSError as e:
            log.debug("%s: %s", rep.STATUS_NAME, e)
        if self.on_lag is not None and newest_local is not None:
            self.on_lag(newest_local, lag_steps, lag_s)


def start_for(cfg, run_dir: Path, retention: Retention, views=None, resumed_from: int = 0,
              on_incident: Callable[[str, dict], None] | None = None) -> Replicator | None:
    """The run's replicator when `checkpoint.replica` is set (rank 0): started, told that the run goes on from step
    `resumed_from` (the replica's checkpoints above it belong to an abandoned timeline), applying the run's one
    retention policy to the replica and sparing in it the newest replicated checkpoint and the one uploading.
    `on_incident(kind, detail)`: where an outage and its catch-up go (the ledger's markers, rundir/incidents.py)."""
    if not cfg.replica:
        return None

    def on_lag(step: int, lag_steps: int, lag_s: float) -> None:
        try:
            views.add_replica(step, lag_steps, lag_s)
        except RuntimeError:  # TensorBoard already closed at the end of the run
            pass
    r = Replicator(cfg.replica, run_dir, retention=retention, on_lag=on_lag if views is not None else None,
                   base_delay=testhooks.replica_backoff(), on_incident=on_incident)
    retention.spare("replica", r.protected)
    r.supersede(resumed_from)
    return r.start()
