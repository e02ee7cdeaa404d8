"""The life of one training process: an asyncio loop that owns signals, checkpoints, the ledger and sidecars.

Threads: the event loop (this module: signals, start-up, data prep, the step loop; control/run/boundary.py: what
happens at each step boundary); `andrea-train` (model steps, snapshots, evals, samples — the only thread that
touches the model; on CPU its snapshot copies run on the trainer's own `andrea-snapshot` thread, fenced like a
CUDA copy stream); `andrea-io` (every file write, in submission order: ledger appends, sidecars, checkpoint
commits). Single-thread executors keep each resource owned by one thread, so ordering is by construction: a ledger
append submitted before a commit lands first.

This module is the wiring: the lock and `train.pid`, signals turned into `Requests` (SIGTERM/SIGINT stop, SIGUSR1
checkpoint, SIGHUP pivot; acted on at the next boundary), the start (trainer, data, --init-from or resume, the
writer, the guard, the views, the ledger's feed, the replica: each built once its collaborators exist and handed
them then, never patched afterwards), then `Boundary.cross` / `Boundary.advance` until a stop, and the clean-up
(two exit stacks: each release registered as its resource is acquired; `main` says the order). Under torchrun
(`self.world`, andrea/control/parallel/distributed.py) every rank runs this loop in lockstep; the model is ZeRO-1 (andrea/control/parallel/zero.py),
the commit is sharded (control/commit/shards.py); rank 0 alone holds the lock, the ledger, the sidecars and the audits.
The watchdog (control/observe/watchdog.py) watches the threads while the step loop runs; notices (control/observe/notify.py) go
out for what an operator acts on. The step's test hooks (andrea/testhooks.py: ANDREA_TEST_POISON_STEPS, _FLIP_WEIGHT, _HANG, _STEP_DELAY) go
through one seam, control/run/step_hooks.py, which is None in production.
Reads `run.toml`, checkpoints, `tokenizer.json` and `data/`; writes `train.pid`, `run.toml` and, through the
boundary, everything listed in sidecars.py, `.loss.json` (control/run/ledger_feed.py) and `step_NNNNNN.bin` (checkpoint.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import uuid
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from andrea.evals import audit
from andrea.model.init_from import load_init_weights
from andrea.control.observe import mfu
from andrea.config.schema import RunConfig
from andrea.config.check import ConfigError
from andrea.control.run import identity, resume
from andrea.control.observe import notify, tensorboard, views, wandb_log, watchdog
from andrea.control.observe.plateau import Plateau
from andrea.control.mixture import pivot
from andrea.control.parallel import ranks, sharing
from andrea.control.replica import replicator
from andrea.control.guard import rollback
from andrea.control.guard.decisions import remedy_in_force
from andrea.control.commit import shards
from andrea.control.run.boundary import Boundary, RunFailed
from andrea.control.run.heldout import HeldOut
from andrea.control.run.ledger_feed import LedgerFeed, ThreadMarkers, open_ledger
from andrea.control.run.observers import Observer, ToNotices, ToReplica, ToViews
from andrea.control.mixture.proxy import Batch, DataProxy
from andrea.control.run.records import StepRecords
from andrea.control.run.started import Started
from andrea.control.run.stalls import Stalls
from andrea.control.run.step_hooks import StepHooks
from andrea.control.run.early_signals import EarlySignals
from andrea.control.run.signals import Requests, abort_now, install_handlers, remove_handlers
from andrea.data.preparation import Interrupted
from andrea.control.parallel.distributed import World
from andrea.control.observe.progress import Progress
from andrea.control.observe import banner
from andrea.rundir import atomic, checkpoint as ckpt, names
from andrea.rundir.names import LEDGER_NAME
from andrea.rundir.ledger import marker, readable_entries
from andrea.rundir.retention import Retention
from andrea.rundir.runlock import RunLock
from andrea.control.run.trainer import Trainer
from andrea.control.parallel.zero import trainer_for

log = logging.getLogger("andrea.control.run")


class TrainingRun:
    def __init__(self, cfg: RunConfig, run_dir: Path, *, device: torch.device, kernels: str,
                 init_from: Path | None = None, early: EarlySignals | None = None, world: World | None = None,
                 accept_ledger_gap: bool = False):
        self.run_dir = run_dir
        self.world = world or World()  # torchrun's ranks (andrea/control/parallel/distributed.py); one process: no-ops
        self.device, self.kernels, self.init_from = device, kernels, init_from
        self.accept_ledger_gap = accept_ledger_gap  # continue past a ledger the checkpoint does not vouch for
        self.req = Requests()
        self.started: Started | None = None  # what `start` built (trainer, data, writer, guard, ledger, views...)
        self.boundary: Boundary | None = None  # the run's position once it has started (step, cfg, data)
        self._cfg, self._resumed = cfg, 0  # until then: the configuration, and the step resumed from
        # Both threads wait on or launch GPU work: each makes this rank's GPU current first (a thread starts on
        # device 0; World.device set it for the main thread only).
        on_device = World.thread_initializer(device)
        self.beats = watchdog.Beats()  # each job on these threads is progress the watchdog sees
        self.io = watchdog.WatchedExecutor(self.beats, "io", thread_name_prefix="andrea-io", initializer=on_device)
        self.train = watchdog.WatchedExecutor(self.beats, "train", thread_name_prefix="andrea-train",
                                              initializer=on_device)
        self.notifier = notify.Notifier(cfg.notify, run_dir, self.world.rank)
        self.early = early
        self.preparing = False  # rank 0 is preparing data (a stop then ends the preparation, not a step)
        self.skipped: list[str] = []  # newer checkpoints the start skipped as invalid, and why (control/run/resume.py)
        self.stalls = Stalls(self.world, self.io, self.notifier, lambda: self.step, self._append_marker)
        # the step's test hooks, one seam (control/run/step_hooks.py, andrea/testhooks.py): None in production
        self.step_hooks = StepHooks.from_env(self.world.rank)

    @property
    def step(self) -> int:
        """Header step of the state the trainer holds."""
        return self.boundary.step if self.boundary is not None else self._resumed

    @property
    def cfg(self) -> RunConfig:
        """The configuration in force (a pivot replaces its policy)."""
        return self.boundary.cfg if self.boundary is not None else self._cfg

    # --- signals: each one only records a request, acted on at the next boundary --------------------------------
    def on_signal(self, sig: signal.Signals) -> None:
        self.req.received.append(sig.name)
        ck = self.cfg.checkpoint
        if sig in (signal.SIGTERM, signal.SIGINT):
            if self.early is not None and self.early.deadline is not None:
                self.early.deadline.arm(sig)  # bounded while the start lasts (control/run/start_deadline.py)
            if self.req.stop is not None and sig == signal.SIGINT:
                abort_now()
            self.req.stop = sig.name
            if self.preparing:
                log.warning("%s received: stopping data preparation at the next chunk (what is done is kept)",
                            sig.name)
                return
            log.warning("%s received: finishing step %d, then writing its checkpoint and exiting "
                        "(a SIGINT%s aborts without it)", sig.name, self.step + 1,
                        " again" if sig == signal.SIGINT else "")
        elif sig == signal.SIGUSR1:
            if self.req.ask_checkpoint(self.step, ck.every, ck.usr1):
                log.info("SIGUSR1 received: checkpoint at step %d, then training continues", self.req.checkpoint_at)
            else:
                log.info("SIGUSR1 received: coalesced into the checkpoint of step %d, not yet landed",
                         self.req.pending_step)
        elif sig == signal.SIGHUP:
            self.on_sighup()

    def on_sighup(self) -> None:
        """Hot pivot: take the policy in RUN_DIR/policy.next.toml at the next (aligned) checkpoint."""
        path = self.run_dir / names.NEXT_POLICY_NAME
        if not path.exists():
            log.warning("SIGHUP received: no %s, nothing to pivot to; training continues", path)
            return
        try:
            self.req.policy = pivot.read_policy(path, self.cfg)
        except ConfigError as e:
            log.error("SIGHUP received: refusing the new policy, training continues unchanged: %s", e)
            return
        self.req.ask_pivot(self.step, self.cfg.checkpoint.every, self.cfg.checkpoint.usr1)
        log.warning("SIGHUP received: pivot to %s at the checkpoint of step %d", path.name, self.req.checkpoint_at)

    # --- start -------------------------------------------------------------------------------------------
    def prepare_data(self) -> tuple:
        """Rank 0 (on separate disks, the first rank of each) prepares what is not prepared yet, polling for a stop
        request (ranks.prepare_data)."""
        self.preparing = ranks.prepares(self.world)
        watchdog.test_hang("start", 0, self.world.rank)  # test hook ANDREA_TEST_HANG=start@0 (andrea/testhooks.py)
        try:
            return ranks.prepare_data(self.world, self.cfg, self.run_dir, should_stop=lambda: self.req.stop is not None)
        finally:
            self.preparing = False

    async def start(self, held: ExitStack) -> Started:
        """The trainer, the data, the weights (--init-from or the checkpoint resumed from), the ledger, the writer,
        the guard, the views, the ledger's feed and the replica: everything the step loop needs, built in this
        order, each with its collaborators. What must be released at the end registers its release on `held` as
        it is acquired (main says the order)."""
        loop = asyncio.get_running_loop()
        trainer = await loop.run_in_executor(self.train, trainer_for, self.world, self.cfg, self.device, self.kernels)
        codec, arms = await loop.run_in_executor(self.train, self.prepare_data)
        if self.init_from is not None:  # rank 0 checks the run's tokenizer is the checkpoint's; refused on every rank
            sharing.leader_only(self.world, lambda: identity.check_init_from_tokenizer(
                self.init_from, identity.run_tokenizer_sha256(self.run_dir, self.cfg)))
        tasks = sharing.leader_only(self.world, audit.TaskAudit.configured, self.cfg, codec)
        # --init-from weights (safetensors, npz, an exported directory): loaded now, step 0, m = v = 0
        # (model/init_from.py)
        imported = await loop.run_in_executor(self.train, load_init_weights, self.init_from, trainer,
                                              self.run_dir)
        watchdog.test_hang("start", 1, self.world.rank)  # ANDREA_TEST_HANG=start@1: on the event loop's thread
        found = None

        def pick():  # rank 0 picks the checkpoint (reading and checking it once); every rank hears which, or why none
            nonlocal found
            found = resume.resume_point(self.run_dir, self.init_from, trainer.n, self.skipped)
            return found[0] if found is not None else None
        info = None if imported else sharing.leader_decides(self.world, pick)
        ledger, ends, lines = open_ledger(self.run_dir, info, held, world=self.world,
                                          accept_gap=self.accept_ledger_gap, skipped=self.skipped)
        proxy, writer, guard, meter, heldout, retention = await self.resume_or_begin(trainer, arms, info, found,
                                                                                     imported, lines)
        shown = self.open_views(held) if self.world.leader else None
        # every batch of ledger lines handed to the I/O thread goes to the views and the notices (rank 0)
        feed = LedgerFeed(ledger, self.io, lines=lines, on_flush=notify.chain(
            shown.add_records if shown is not None else None, self.notifier.lines) if self.world.leader else None)
        if self.world.leader:
            atomic.write_atomic(self.run_dir / names.CONFIG_NAME, self.cfg.to_toml().encode())
        feed.flush(force_sync=True)
        replica = None
        if self.world.leader:  # after the start marker is durable: the replica is claimed with it
            replica = replicator.start_for(self.cfg.checkpoint, self.run_dir, retention, shown,
                                           resumed_from=self.step,
                                           on_incident=ends.to_ledger(asyncio.get_running_loop(), feed,
                                                                      lambda: self.step))
        if replica is not None:
            held.callback(self.finish_replica, replica, ends)
        return Started(cfg=self.cfg, run_dir=self.run_dir, world=self.world, step=self.step, trainer=trainer,
                       proxy=proxy, writer=writer, guard=guard, ledger=ledger, feed=feed, codec=codec, tasks=tasks,
                       meter=meter, train=self.train, io=self.io, heldout=heldout, retention=retention, views=shown,
                       replicator=replica)

    def open_views(self, held: ExitStack) -> views.Views | None:
        """log.tensorboard and log.wandb (the ledger on disk now is W&B's backfill), their close registered on
        `held`: at the end each shows what the boundary's settled step releases, bounded (log.wandb_timeout_s)."""
        log_every = self.cfg.train.log_every
        shown = views.open_views(tensorboard.open_log(self.cfg.log, self.run_dir, self.step, log_every),
                                 wandb_log.open_log(self.cfg.log, self.run_dir, self.cfg.to_dict(), log_every))
        if shown is not None:
            held.callback(lambda: shown.close(self.boundary.settled_step() if self.boundary is not None else None))
        return shown

    def finish_replica(self, replica: replicator.Replicator, ends: ThreadMarkers) -> None:
        """The stop's wait for the replica, bounded (checkpoint.replica_wait, then exit all the same): the event loop
        is blocked in it and the I/O thread is done, so the replicator's markers go to the ledger directly."""
        ends.direct()
        replica.finish(self.cfg.checkpoint.replica_wait)

    async def resume_or_begin(self, trainer: Trainer, arms, info, found, imported: dict | None, lines: list):
        """The start's second half: the first marker (`start`, or `resume` from this run's checkpoint; the weights of
        either checkpoint loaded), then the guard as the checkpoint left it, the held-out history, the retention
        policy and the writer. Returns (proxy, writer, guard, meter, heldout, retention)."""
        loop = asyncio.get_running_loop()
        meter = self.mfu_meter(trainer.n)
        measure = {"flops_per_token": meter.flops_token, "peak_flops": meter.peak.flops,
                   "peak": meter.peak.source}  # what the step entries' `mfu` is measured against

        def start(step: int, **extra) -> dict:
            """A new run's marker (from step 0, imported weights, or --init-from a checkpoint: at its step): its
            identity, which every later identity check and the replica's claim read, and its id, which every
            checkpoint of the run names (rundir/checksum.py)."""
            return marker("start", step, n_params=trainer.n, seed=self.cfg.train.seed,
                          identity=identity.identity(self.cfg, identity.tokenizer_sha256(self.run_dir)), **measure,
                          **extra, run=uuid.uuid4().hex)

        if info is None:
            proxy = DataProxy(self.cfg, arms)
            lines.append(start(0, **(imported or {})))
        else:  # on separate disks rank 0 reads and validates, and sends the others theirs (control/parallel/sharing.py)
            def read() -> np.ndarray:  # rank 0 has it; another rank of a shared directory reads its own
                return found[1] if found is not None else ckpt.read_payload(info.path, trainer.n)[1]
            payload = await sharing.payload_everywhere(self.world, read, trainer.n, self.train)
            await loop.run_in_executor(self.train, trainer.load, payload)
            self._resumed = info.step
            proxy = resume.restore_proxy(self.cfg, self.run_dir, arms, info, sharing.json_reader(self.world))
            if info.path.parent == self.run_dir:
                lines.append(marker("resume", info.step, phase=proxy.phase, **measure, **{"from": info.path.name}))
            else:  # --init-from a checkpoint: a new run, continuing that one's w, m and v from its step
                lines.append(start(info.step, phase=proxy.phase, **{"from": str(info.path.resolve())}))
        ledger_remedy = lambda: sharing.from_leader(  # noqa: E731  (the companion's copy, when it is lost)
            self.world, lambda: remedy_in_force(readable_entries(self.run_dir / LEDGER_NAME), info.step))
        guard, warning = rollback.load_guard(self.cfg, info, self.run_dir, (imported or {}).get("from"),
                                             sharing.json_reader(self.world),
                                             lambda p: sharing.from_leader(self.world, Path.exists, p), ledger_remedy)
        if warning:
            log.warning("%s", warning)
        if info is not None and proxy.phase > 0 and proxy.phase_start == self.step:  # resumed at a pivot: as
            guard.pivot(self.step, names.checkpoint_name(self.step))  # the hot pivot did (idempotent)
        # the held-out history (rank 0 audits) and the one retention policy, built before the writer that uses it
        heldout = HeldOut.seeded(self.run_dir / LEDGER_NAME, self.step) if self.world.leader else HeldOut()
        retention = Retention.of(self.cfg.checkpoint, heldout.losses)
        retention.spare("guard", guard.protected)  # retention never deletes the known-good checkpoint
        writer = shards.writer_for(self.world, self.run_dir, trainer, self.device, self.io, retention=retention)
        if info is not None and info.path.parent == self.run_dir:
            writer.last_committed = self.step
        trainer.lr_scale, proxy.data_offset = guard.remedy["lr_scale"], guard.remedy["data_offset"]
        return proxy, writer, guard, meter, heldout, retention

    def mfu_meter(self, n_params: int) -> mfu.Meter:
        """MFU of this process (andrea/control/observe/mfu.py): the model's FLOPs per token against the peak of every rank's device
        (bf16: the autocast the trainer runs under on CUDA), over the last `max(train.log_every, 10)` steps."""
        tc, m = self.cfg.train, self.cfg.model
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else ""
        peak = mfu.device_peak(self.device.type, name, "bf16", tc.peak_tflops, self.world.size)
        if peak.flops is None:
            log.info("MFU is not measured: %s", peak.source)
        return mfu.Meter(mfu.model_flops_per_token(m, n_params), peak, tc.batch_size * m.block_size,
                         span=max(tc.log_every, 10))

    # --- the loop ------------------------------------------------------------------------------------------
    async def main(self, stop_at: int, out=sys.stdout) -> int:
        loop = asyncio.get_running_loop()
        # Each release is registered as its resource is acquired and runs in the reverse order (ExitStack), in
        # two layers. `working`, what does the work, is released first: the signal handlers (no new request), the
        # stall watch, the launcher's late signals ignored (World.quiet: after the handlers are gone), the training
        # thread, then the I/O thread (every write queued, by either, has landed). Then `held`, what the run keeps
        # until then, newest first: the replica's bounded wait (its markers then go to the ledger directly, the I/O
        # thread being done), the views (they still hear what that wait tells: the replica's lag and markers), the
        # ledger fsynced and closed (no writer of it is left), the lock (the next start may take the run directory
        # only once every file in it is closed), and last the notices (delivered within notify.timeout_s, the
        # run's end among them).
        with ExitStack() as held:
            held.callback(lambda: self.notifier.close(self.cfg.notify.timeout_s))
            lock = RunLock(self.run_dir)
            if self.world.leader:  # train.pid: rank 0's pid, so `andrea ctl` and SIGHUP reach it directly
                lock.acquire()
            held.callback(lock.release)
            with ExitStack() as working:
                for release in (self.io.shutdown, self.train.shutdown):
                    working.callback(release, wait=True)
                working.callback(self.world.quiet)
                working.callback(self.stalls.stop)
                install_handlers(loop, self.on_signal)
                working.callback(remove_handlers, loop)
                return await self.live(stop_at, held, out)

    async def live(self, stop_at: int, held: ExitStack, out) -> int:
        """The process's life once it holds the run: the start, the banner and the `ready` line, the step loop."""
        if self.early is not None and self.early.deadline is not None:  # a start blocked on this thread: bounded too
            self.early.deadline.chain((signal.SIGTERM, signal.SIGINT))
        for sig in self.early.received if self.early else ():
            self.on_signal(sig)
        try:
            sharing.probe(self.world, self.run_dir)  # before anything reads the run directory
            self.stalls.join()  # the ranks on this host and the stall notes (control/run/stalls.py)
            self._cfg = sharing.from_leader(self.world, lambda: self._cfg)  # separate disks: rank 0's run.toml
            for stale in ckpt.remove_stale_tmp(self.run_dir) if self.world.view == self.world.rank else ():
                log.warning("removed %s left by an interrupted write (never read as a checkpoint or sidecar)",
                            stale.relative_to(self.run_dir))
            run = self.started = await self.start(held)
            if self.world.leader:  # what is about to run (control/observe/banner.py)
                for line in banner.lines(self.cfg, preset=banner.preset_of(self.cfg.model), n_params=run.trainer.n,
                                         step=self.step, stop_at=stop_at, device=str(self.device),
                                         kernels=self.kernels, run_dir=self.run_dir, world_size=self.world.size):
                    log.info("%s", line)
            print(f"ready pid={os.getpid()} run_dir={self.run_dir} step={self.step} "
                  f"stop_at={stop_at} device={self.device} kernels={self.kernels}"
                  + (f" rank={self.world.rank}/{self.world.size}" if self.world.distributed else ""),
                  file=out, flush=True)
            if self.early is not None and self.early.deadline is not None:
                self.early.deadline.settled()  # the loop honours a stop from here (the watchdog watches it)
            return await self.loop(run, stop_at)
        except Interrupted as e:  # a stop during data preparation: nothing trained, everything prepared kept
            log.warning("%s", e)
            return 0
        except Exception:
            self.stalls.explain()  # a hung peer's end may be what failed here
            raise

    def observers(self, run: Started) -> list[Observer]:
        """What the boundary tells of its evals, commits, rollbacks and pivots besides the guard and the held-out
        history (control/run/observers.py): the views, the replica, the notices, the plateau."""
        subscribers: list[Observer] = [ToViews(run.views)] if run.views is not None else []
        if run.replicator is not None:
            subscribers.append(ToReplica(run.replicator))
        return [*subscribers, ToNotices(self.notifier.send),
                Plateau(self.cfg.notify.plateau_evals, run.heldout, run.feed)]

    async def loop(self, run: Started, stop_at: int) -> int:
        """Boundary, step, boundary, ... until a stop; then everything in flight lands."""
        tc, trainer = self.cfg.train, run.trainer
        records = StepRecords(64, tc.batch_size, self.device)
        progress = Progress(self.step, stop_at, tc.batch_size * self.cfg.model.block_size, tc.log_every)
        b = self.boundary = Boundary(run, req=self.req, records=records, progress=progress,
                                     observers=self.observers(run))
        dog = watchdog.Watchdog(self.cfg.watchdog, self.beats, self.stalls.on_stall).start()
        watched = self.beats.watch
        try:
            while not await watched("boundary", b.cross(stop_at)):
                await watched("boundary", b.advance(lambda batch: self._step(trainer, records, batch)))
        except RunFailed as e:
            self.notifier.send("failed", self.step, message=str(e), error=str(e))
            raise
        finally:
            results = await watched("boundary", b.finish())
            dog.stop()
        failed = [r for r in results if r.error and r.step == self.step]
        if failed:
            self.notifier.send("failed", self.step, message=failed[0].error, error=failed[0].error)
            raise RunFailed(failed[0].error)
        self.notifier.send("stopped" if self.req.stop else "finished", self.step,
                           message=f"stopped at step {self.step} ({self.req.stop or 'step target reached'})",
                           signal=self.req.stop)
        log.info("stopped at step %d (%s); newest checkpoint %s", self.step,
                 self.req.stop or "step target reached", names.checkpoint_name(run.writer.last_committed or 0))
        return 0

    def _append_marker(self, line: dict) -> None:
        """On the I/O thread: one marker appended and fsynced (after everything queued before it)."""
        self.started.ledger.append([line])
        self.started.ledger.sync()

    def _step(self, trainer: Trainer, records: StepRecords, batch: Batch) -> int:
        """One update on the training thread; its record goes to `records` without a sync."""
        out = trainer.train_step(batch.step, batch.x, batch.y)
        if self.step_hooks is not None:
            out = self.step_hooks.before_push(out, trainer)
        records.push(out)
        if self.step_hooks is not None:
            self.step_hooks.after_push(out)
        return out.step
