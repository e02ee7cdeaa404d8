"""The life of one training process: an asyncio loop that owns signals, checkpoints, the ledger and sidecars.

Threads: the event loop (this module: decisions, signals, data prep, ledger lines); `andrea-train` (model
steps, snapshots, evals, samples — the only thread that touches the model; on CPU its snapshot copies run on
the trainer's own `andrea-snapshot` thread, fenced like a CUDA copy stream); `andrea-io` (every file write, in
submission order: ledger appends, sidecars, checkpoint commits). Single-thread executors keep each resource
owned by one thread, so ordering is by construction: a ledger append submitted before a commit lands first.

Per step boundary (header step S = updates completed), in this order:
    1. act on requests (SIGTERM/SIGINT stop, SIGUSR1 checkpoint, SIGHUP pivot) and the cadence;
    2. a due checkpoint: drain the step records through S, queue their ledger lines, start the snapshot of
       [w | m | v] into a free staging buffer (it overlaps step S + 1 until that step's optimizer update),
       queue the commit (ledger fsync; `step_S.state.json`, `.state.json`, `step_S.guard.json` with one
       directory fsync; then the atomic `.bin`) — unless the divergence guard
       (control/guard.py, fed every step record) sees trouble: then nothing is committed;
    2b. an incident the guard declared: roll back to its known-good checkpoint (`rollback`), S goes back;
    3. eval / sample audits when due;
    4. launch step S on the training thread, prepare batch S + 1 meanwhile, await the step.
Under torchrun (`self.world`, andrea/distributed.py) every rank runs this loop in lockstep: step 1 starts with
the ranks' request exchange (control/ranks.py), the model is ZeRO-1 (andrea/zero.py), the commit is sharded
(control/shards.py); rank 0 alone holds the lock, the ledger, the sidecars and the audits.
Test hook: `ANDREA_TEST_STEP_DELAY=<seconds>` sleeps after each step (a window for signals); never in production.
Test hook: `ANDREA_TEST_POISON_STEPS=<n>[,<n>...]` makes the step record of header step n read loss = NaN the first
time this process reaches n (the weights are untouched): a divergence at a chosen step on any machine, which the
guard meets as a non-finite incident (tests/test_guard_run.py). Never in production.
Reads `run.toml`, checkpoints, `tokenizer.json` and `data/`; writes everything listed in sidecars.py,
`.loss.json` (control/ledger.py) and `step_NNNNNN.bin` (checkpoint.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from andrea import audit, export
from andrea import checkpoint as ckpt
from andrea.config import ConfigError, RunConfig
from andrea.control import pivot, resume, rollback, sidecars
from andrea.control.guard import INCIDENT, SUSPECT
from andrea.control.ledger import LEDGER_NAME, LedgerFeed, LossLedger, marker
from andrea.control.proxy import Batch, DataProxy
from andrea.control.records import StepRecord, StepRecords
from andrea.control import ranks, shards
from andrea.control.runlock import RunLock
from andrea.control import tensorboard
from andrea.control.signals import (EarlySignals, Requests, abort_now, boundary_action, install_handlers,
                                    remove_handlers)
from andrea.data import store
from andrea.data.prepare import Interrupted
from andrea.progress import Progress
from andrea.distributed import World
from andrea.trainer import Trainer
from andrea.zero import trainer_for

log = logging.getLogger("andrea.run")


class RunFailed(RuntimeError):
    """The run stopped without the guarantee it owes (e.g. the final checkpoint could not be written)."""


def poison_steps(text: str) -> set[int]:
    """The steps of the ANDREA_TEST_POISON_STEPS test hook ("33" or "33,70"; empty: none)."""
    try:
        steps = {int(part) for part in text.split(",") if part.strip()}
    except ValueError:
        steps = {0}
    if min(steps, default=1) < 1:
        raise ConfigError(f"ANDREA_TEST_POISON_STEPS={text!r}: expected header steps >= 1, comma-separated")
    return steps


class TrainingRun:
    def __init__(self, cfg: RunConfig, run_dir: Path, *, device: torch.device, kernels: str,
                 init_from: Path | None = None, early: EarlySignals | None = None, world: World | None = None):
        self.cfg, self.run_dir = cfg, run_dir
        self.world = world or World()  # torchrun's ranks (andrea/distributed.py); one process: no-ops
        self.device, self.kernels, self.init_from = device, kernels, init_from
        self.req = Requests()
        self.step = 0  # header step of the state the trainer holds
        # Both threads wait on or launch GPU work: each makes this rank's GPU current first (a thread starts on
        # device 0; World.device set it for the main thread only).
        on_device = World.thread_initializer(device)
        self.io = ThreadPoolExecutor(1, thread_name_prefix="andrea-io", initializer=on_device)
        self.train = ThreadPoolExecutor(1, thread_name_prefix="andrea-train", initializer=on_device)
        self.tb: tensorboard.TensorBoardLog | None = None  # log.tensorboard: the ledger's lines as scalars
        self.early = early
        self.preparing = False  # rank 0 is preparing data (a stop then ends the preparation, not a step)
        self.step_delay = float(os.environ.get("ANDREA_TEST_STEP_DELAY", "0") or 0)  # test hook: slow steps
        self.poison_steps = poison_steps(os.environ.get("ANDREA_TEST_POISON_STEPS", ""))  # test hook: NaN records

    # --- signals -------------------------------------------------------------------------------------------
    def on_signal(self, sig: signal.Signals) -> None:
        self.req.received.append(sig.name)
        ck = self.cfg.checkpoint
        if sig in (signal.SIGTERM, signal.SIGINT):
            if self.req.stop is not None and sig == signal.SIGINT:
                abort_now()
            self.req.stop = sig.name
            if self.preparing:
                log.warning("%s received: stopping data preparation at the next chunk (what is done is kept)",
                            sig.name)
                return
            log.warning("%s received: finishing step %d, then writing its checkpoint and exiting "
                        "(send SIGINT again to abort without it)", sig.name, self.step + 1)
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
        path = self.run_dir / pivot.NEXT_POLICY
        if not path.exists():
            log.warning("SIGHUP received: no %s, nothing to pivot to; training continues", path)
            return
        try:
            self.next_cfg = pivot.read_policy(path, self.cfg)
        except ConfigError as e:
            log.error("SIGHUP received: refusing the new policy, training continues unchanged: %s", e)
            return
        self.req.ask_pivot(self.step, self.cfg.checkpoint.every, self.cfg.checkpoint.usr1)
        log.warning("SIGHUP received: pivot to %s at the checkpoint of step %d", path.name, self.req.checkpoint_at)

    def pivot(self, proxy: DataProxy) -> DataProxy:
        """At the pivot checkpoint: queue the archive (after that checkpoint's sidecars) and start a new phase."""
        new_cfg, step, phase = self.next_cfg, self.step, proxy.phase + 1
        self.req.pivot = False

        def archive() -> None:
            if not self.world.leader:  # rank 0 archives; the other ranks only change policy
                return
            self.ledger.append([pivot.apply_pivot(self.run_dir, new_cfg, step, phase)])
            self.ledger.sync()
            (self.run_dir / pivot.NEXT_POLICY).unlink(missing_ok=True)

        self.io.submit(archive).result()  # the I/O thread is FIFO: runs after the checkpoint's commit
        self.cfg = new_cfg
        log.warning("pivot at step %d: phase %d under caps %s floors %s", step, phase, new_cfg.policy.caps,
                    new_cfg.policy.floors)
        return DataProxy(new_cfg, proxy.arms, phase=phase, phase_start=step)

    # --- start -------------------------------------------------------------------------------------------
    def prepare_data(self) -> tuple:
        """Rank 0 prepares what is not prepared yet, polling for a stop request (ranks.prepare_data)."""
        self.preparing = self.world.leader
        try:
            return ranks.prepare_data(self.world, self.cfg, self.run_dir, should_stop=lambda: self.req.stop is not None)
        finally:
            self.preparing = False

    async def start(self) -> tuple[Trainer, DataProxy]:
        loop = asyncio.get_running_loop()
        trainer = await loop.run_in_executor(self.train, trainer_for, self.world, self.cfg, self.device, self.kernels)
        codec, arms = await loop.run_in_executor(self.train, self.prepare_data)
        self.codec = codec
        # --init-from weights (safetensors, npz, a GPT-2 directory): loaded now, step 0, m = v = 0 (export.py)
        imported = await loop.run_in_executor(self.train, export.load_init_weights, self.init_from, trainer,
                                              self.run_dir)
        info = None if imported else self.world.broadcast(
            resume.resume_point(self.run_dir, self.init_from, trainer.n) if self.world.leader else None)
        if info is None:
            proxy = DataProxy(self.cfg, arms)
            self.feed.lines.append(marker("start", 0, n_params=trainer.n, seed=self.cfg.train.seed,
                                          **(imported or {})))
        else:
            step, payload = await loop.run_in_executor(self.train, ckpt.read_payload, info.path, trainer.n)
            await loop.run_in_executor(self.train, trainer.load, torch.from_numpy(payload))
            self.step = step
            proxy = resume.restore_proxy(self.cfg, self.run_dir, arms, info)
            origin = info.path.name if info.path.parent == self.run_dir else str(info.path.resolve())
            self.feed.lines.append(marker("resume", step, phase=proxy.phase, **{"from": origin}))
        self.writer = shards.writer_for(self.world, self.run_dir, trainer, self.device, self.io,
                                       keep_last=self.cfg.checkpoint.keep_last,
                                       keep_every=self.cfg.checkpoint.keep_every)
        if info is not None and info.path.parent == self.run_dir:
            self.writer.last_committed = self.step
        self.guard, warning = rollback.load_guard(self.cfg, info, self.run_dir, (imported or {}).get("from"))
        if warning:
            log.warning("%s", warning)
        if info is not None and proxy.phase > 0 and proxy.phase_start == self.step:  # resumed at a pivot: as
            self.guard.pivot(self.step, ckpt.checkpoint_name(self.step))  # the hot pivot did (idempotent)
        self.writer.protected = self.guard.protected  # retention never deletes the known-good checkpoint
        trainer.lr_scale, proxy.data_offset = self.guard.remedy["lr_scale"], self.guard.remedy["data_offset"]
        return trainer, proxy

    # --- records and the ledger ----------------------------------------------------------------------------
    def take_records(self, records: list[StepRecord], proxy: DataProxy, progress: Progress) -> None:
        tokens_per_step = self.cfg.train.batch_size * self.cfg.model.block_size
        for r in records:
            if self.guard.pending is not None:
                break  # records after a detected incident belong to the timeline the rollback abandons
            finite = bool(np.isfinite(r.loss) and np.isfinite(r.grad_norm))
            if not finite and not self.cfg.guard.enabled:
                raise RunFailed(f"step {r.step}: loss {r.loss} / grad norm {r.grad_norm} is not finite; stopping "
                                f"without checkpointing the diverged state (resume from the last checkpoint with a "
                                f"lower train.lr)")
            verdict = self.guard.observe(r.step, r.loss, r.grad_norm)
            if verdict == INCIDENT:
                log.warning("guard: incident at step %d: %s; rolling back to step %d", r.step,
                            self.guard.pending["reason"], self.guard.good["step"])
            elif verdict == SUSPECT and self.guard.detector.flags[-1]:
                log.warning("guard: step %d anomalous: %s (%d of the last %d steps)", r.step, self.guard.last_reason,
                            sum(self.guard.detector.flags), len(self.guard.detector.flags))
            self.feed.lines += [marker("recovered", s) for s in self.guard.recovered]
            self.guard.recovered.clear()
            if not finite:
                continue
            proxy.observe(r.step, r.seq_losses)
            self.feed.lines.append({"step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                                    "tokens": r.step * tokens_per_step, "time": round(time.time(), 3),
                                    "phase": proxy.phase})
            progress.update(r.step, r.loss, r.lr)

    # --- checkpoints ---------------------------------------------------------------------------------------
    async def checkpoint(self, trainer: Trainer, proxy: DataProxy, records: StepRecords,
                         progress: Progress) -> bool:
        """Take the checkpoint of the current step unless the guard sees trouble; True if it was taken."""
        step = self.step
        self.take_records(records.pop_ready(wait_until_step=step), proxy, progress)
        self.feed.flush(force_sync=True)
        if not self.guard.may_commit():  # never checkpoint (or let retention pass) over the last good state
            good = (f"{self.guard.good['path']}, on disk" if self.guard.good["path"] else
                    "the initial state, which a restart re-creates")
            why = "it is diverging" if self.guard.pending else f"the guard sees trouble ({self.guard.last_reason})"
            if self.req.stop is not None:
                log.warning("%s during an incident: writing nothing, %s; the last good state is %s",
                            self.req.stop, why, good)
            else:
                log.warning("not checkpointing step %d: %s; the last good state is %s", step, why, good)
            return False
        state = proxy.state(step)
        guard_state = self.guard.on_checkpoint(step, ckpt.checkpoint_name(step))
        slot = await self.writer.free_slot()
        t0 = time.perf_counter()
        fence = await asyncio.get_running_loop().run_in_executor(self.train, trainer.snapshot,
                                                                 self.writer.staging[slot])
        self.writer.stall_seconds.append(time.perf_counter() - t0)
        if self.tb is not None:
            self.tb.add_checkpoint(step, state, self.writer.stall_seconds[-1])

        def before_commit() -> None:
            self.ledger.sync()
            state_json = sidecars.json_bytes(state)
            sidecars.write_many({sidecars.checkpoint_state_path(self.run_dir, step): state_json,
                                 self.run_dir / sidecars.STATE_NAME: state_json,
                                 rollback.companion_path(self.run_dir, step): sidecars.json_bytes(guard_state)})

        commit = self.writer.start_commit(slot, step, fence, before_commit)
        commit.add_done_callback(lambda fut: self._landed(fut, step))
        if self.tb is not None:
            commit.add_done_callback(self.tb.on_commit)
        if self.req.checkpoint_at is not None and step >= self.req.checkpoint_at:
            self.req.checkpoint_at, self.req.landing = None, step
            commit.add_done_callback(lambda _: setattr(self.req, "landing", None))
        return True

    def _landed(self, fut: asyncio.Future, step: int) -> None:
        """A commit's outcome, on the loop thread: a failed one is never confirmed as the guard's good point."""
        if fut.cancelled() or fut.exception() is not None or fut.result().error is not None:
            self.guard.on_commit_failed(step)

    async def audit(self, trainer: Trainer, proxy: DataProxy) -> None:
        """Validation loss and sample audits at their cadences (never at step 0)."""
        if not self.world.leader:  # rank 0 audits; the ledger and .samples.json are its alone
            return
        loop, step = asyncio.get_running_loop(), self.step
        if step > 0 and step % self.cfg.train.eval_every == 0:
            losses = await loop.run_in_executor(self.train, audit.evaluate, trainer, proxy.arms, self.cfg)
            val = sum(losses.values()) / len(losses)
            target = audit.target_loss(losses, dict(zip(proxy.names, proxy.policy.target_weights())))
            self.feed.lines.append(marker("eval", step, val_loss=val, target_loss=target, arms=losses))
            log.info("step %d val_loss %.4f (%s)", step, val, ", ".join(f"{k} {v:.3f}" for k, v in losses.items()))
        every = self.cfg.sample.every or self.cfg.checkpoint.every
        if step > 0 and step % every == 0 and self.codec is not None and self.cfg.sample.prompts:
            audits = await loop.run_in_executor(self.train, audit.sample_audits, trainer, self.codec, self.cfg, step)
            self.io.submit(self._write_audits, audits)

    def _write_audits(self, audits: list[dict]) -> None:
        try:
            sidecars.append_audit(self.run_dir, audits, self.cfg.sample.keep)
        except OSError as e:  # an audit is worth a warning, never the run
            log.error("%s: sample audit of step %d not written: %s", sidecars.SAMPLES_NAME, audits[0]["step"], e)

    # --- the loop ------------------------------------------------------------------------------------------
    async def main(self, stop_at: int, out=sys.stdout) -> int:
        loop = asyncio.get_running_loop()
        lock = RunLock(self.run_dir)
        if self.world.leader:  # train.pid: rank 0's pid, so `andrea ctl` and SIGHUP reach it directly
            lock.acquire()
        install_handlers(loop, self.on_signal)
        for sig in self.early.received if self.early else ():
            self.on_signal(sig)
        try:
            for stale in ckpt.remove_stale_tmp(self.run_dir) if self.world.leader else ():
                log.warning("removed %s left by an interrupted write (never read as a checkpoint or sidecar)",
                            stale.relative_to(self.run_dir))
            self.ledger = (LossLedger if self.world.leader else ranks.FollowerLedger)(self.run_dir / LEDGER_NAME)
            self.feed = LedgerFeed(self.ledger, self.io)
            if self.ledger.torn_bytes:
                log.warning("%s: cut a torn last line of %d bytes left by a crash", LEDGER_NAME,
                            self.ledger.torn_bytes)
            trainer, proxy = await self.start()
            if self.world.leader:
                self.tb = tensorboard.open_log(self.cfg.log, self.run_dir, self.step, self.cfg.train.log_every)
                self.feed.on_flush = self.tb.add_records if self.tb is not None else None
                sidecars.write_atomic(self.run_dir / sidecars.CONFIG_NAME, self.cfg.to_toml().encode())
            self.feed.flush(force_sync=True)
            print(f"ready pid={os.getpid()} run_dir={self.run_dir} step={self.step} "
                  f"stop_at={stop_at} device={self.device} kernels={self.kernels}"
                  + (f" rank={self.world.rank}/{self.world.size}" if self.world.distributed else ""),
                  file=out, flush=True)
            return await self.loop(trainer, proxy, stop_at)
        except Interrupted as e:  # a stop during data preparation: nothing trained, everything prepared kept
            log.warning("%s", e)
            return 0
        finally:
            remove_handlers(loop)
            self.world.quiet()
            self.train.shutdown(wait=True)
            self.io.shutdown(wait=True)
            if self.tb is not None:
                self.tb.close()
            if hasattr(self, "ledger"):
                self.ledger.close()
            lock.release()

    async def loop(self, trainer: Trainer, proxy: DataProxy, stop_at: int) -> int:
        loop = asyncio.get_running_loop()
        ck, tc = self.cfg.checkpoint, self.cfg.train
        records = StepRecords(64, tc.batch_size, self.device)
        progress = Progress(self.step, stop_at, tc.batch_size * self.cfg.model.block_size, tc.log_every)
        batch: Batch = await loop.run_in_executor(None, proxy.batch, self.step)
        start = self.step
        try:
            while True:
                if self.writer.last_error and ck.on_write_error == "stop" and self.req.failed is None:
                    self.req.failed = self.writer.last_error  # every rank exits at the boundary that shares it
                if ranks.share(self.world, self.req):  # a hot pivot asked on rank 0: the same policy file
                    self.next_cfg = pivot.read_policy(self.run_dir / pivot.NEXT_POLICY, self.cfg)
                action = boundary_action(self.step, stop_at, ck.every, self.req)
                taken = True
                if action.checkpoint and self.writer.last_committed != self.step:
                    taken = await self.checkpoint(trainer, proxy, records, progress)
                if self.guard.pending is not None:
                    proxy, batch = await self.rollback(trainer, proxy, records, progress)
                    start = self.step  # the good step's audits ran in the timeline that first reached it
                    if self.req.stop is None:
                        continue
                    log.warning("%s during an incident: rolled back to %s, which is on disk; writing nothing "
                                "more", self.req.stop, self.guard.good["path"])
                    break
                if action.pivot and taken:  # a pivot waits for its checkpoint (the guard may hold it back)
                    self.feed.flush(force_sync=True)
                    proxy = await loop.run_in_executor(None, self.pivot, proxy)
                    self.guard.pivot(self.step, ckpt.checkpoint_name(self.step))
                    proxy.data_offset = self.guard.remedy["data_offset"]
                    batch = proxy.batch(self.step)
                if self.step != start:  # the start step's audits ran before the previous process stopped
                    await self.audit(trainer, proxy)
                if action.stop:
                    break
                if self.req.failed:
                    raise RunFailed(self.req.failed)
                self.take_records(records.make_room(), proxy, progress)
                fut = loop.run_in_executor(self.train, self._step, trainer, records, batch)
                next_step = self.step + 1
                self.take_records(records.pop_ready(wait_until_step=proxy.cut_for(next_step)), proxy, progress)
                batch = proxy.batch(next_step) if self.guard.pending is None else batch  # else: rolled back
                self.step = await fut
                if trainer.micro_batch_choice is not None:  # train.micro_batch_size = "auto" decided
                    self.record_micro_batch(trainer)
                self.take_records(records.pop_ready(), proxy, progress)
                self.feed.flush()
        finally:
            progress.close()
            self.take_records(records.pop_ready(wait_until_step=self.step), proxy, progress)
            self.feed.flush(force_sync=True)
            results = await self.writer.drain()
            self.feed.wait()
            if self.ledger.backlog:
                raise RunFailed(f"{self.ledger.path}: {self.ledger.backlog} ledger lines could not be written "
                                "(disk full?); the last committed checkpoint precedes them")
        failed = [r for r in results if r.error and r.step == self.step]
        if failed:
            raise RunFailed(failed[0].error)
        log.info("stopped at step %d (%s); newest checkpoint %s", self.step,
                 self.req.stop or "step target reached", ckpt.checkpoint_name(self.writer.last_committed or 0))
        return 0

    def record_micro_batch(self, trainer: Trainer) -> None:
        """`micro_batch_size = "auto"` chose at its first step: a ledger marker, and run.toml holds the number (a
        resume reuses it instead of probing again)."""
        choice, trainer.micro_batch_choice = trainer.micro_batch_choice, None
        self.cfg.train.micro_batch_size = choice["micro_batch_size"]
        self.feed.lines.append(marker("micro_batch", self.step - 1, **choice))
        log.info("train.micro_batch_size=auto: %d rows per pass (of %d per step%s), recorded in run.toml",
                 choice["micro_batch_size"], choice["rows"], " per rank" if self.world.distributed else "")
        if self.world.leader:
            self.io.submit(sidecars.write_atomic, self.run_dir / sidecars.CONFIG_NAME, self.cfg.to_toml().encode())

    def _step(self, trainer: Trainer, records: StepRecords, batch: Batch) -> int:
        out = trainer.train_step(batch.step, batch.x, batch.y)
        if out.step in self.poison_steps:  # test hook: once per process (a rollback's replay of n stays healthy)
            self.poison_steps.discard(out.step)
            out = dataclasses.replace(out, loss=torch.full_like(out.loss, float("nan")))
        records.push(out)
        if self.step_delay:
            time.sleep(self.step_delay)
        return out.step

    # --- the guard's rollback (decisions: control/guard.py; files: control/rollback.py) -------------------------
    async def rollback(self, trainer: Trainer, proxy: DataProxy, records: StepRecords,
                       progress: Progress) -> tuple[DataProxy, Batch]:
        """Back to the known-good point with the planned remedy, made durable before training goes on.

        Order on the I/O thread (FIFO): ledger markers (fsynced), the good point's guard companion (or the good
        state committed as a checkpoint when it is not one in this directory), then the abandoned timeline's
        checkpoints deleted. A crash anywhere in between resumes from a checkpoint whose replay takes the same
        decisions again.
        """
        loop, g = asyncio.get_running_loop(), self.guard
        records.pop_ready(wait_until_step=1 << 62)  # in flight after the incident: dropped
        plan, pending = g.plan(), g.pending
        value = lambda x: x if np.isfinite(x) else str(x)  # noqa: E731  (JSON has no inf/nan)
        self.feed.lines.append(marker("incident", plan.incident_step, reason=plan.reason,
                                      loss=value(pending["loss"]), grad_norm=value(pending["grad_norm"]),
                                      attempt=plan.attempt))
        await self.writer.drain()
        if plan.give_up:
            start_from = plan.to_path or "the initial state (start the run again)"
            self.feed.lines.append(marker("guard_stop", plan.incident_step, attempts=plan.attempt,
                                          resume_from=plan.to_path))
            self.feed.flush(force_sync=True)
            if rollback.in_run_dir(g, self.run_dir) and self.world.leader:
                self.io.submit(rollback.write_companion, self.run_dir, plan.to_step, g.state_after_give_up())
            if self.world.leader:
                self.io.submit(rollback.drop_after, self.run_dir, plan.to_step).result()
            raise RunFailed(plan.message(start_from))
        payload = await loop.run_in_executor(self.train, rollback.good_payload, g, self.run_dir, self.cfg, trainer)
        await loop.run_in_executor(self.train, trainer.load, payload)
        g.apply(plan)
        self.step, trainer.lr_scale = plan.to_step, plan.lr_scale
        info = ckpt.CheckpointInfo(self.run_dir / ckpt.checkpoint_name(plan.to_step), plan.to_step, trainer.n)
        proxy = resume.restore_proxy(self.cfg, self.run_dir, proxy.arms, info)
        proxy.data_offset = plan.data_offset
        self.feed.lines.append(marker("rollback", plan.to_step, checkpoint=plan.to_path or "initial state",
                                      attempt=plan.attempt, remedy=plan.remedy, data_offset=plan.data_offset,
                                      lr_scale=plan.lr_scale, **{"from": plan.incident_step}))
        log.warning("guard: rolled back from step %d to %s (attempt %d of %d: %s; data offset %d, lr scale %g)",
                    plan.incident_step, plan.to_path or "the initial state", plan.attempt, self.cfg.guard.max_attempts,
                    plan.remedy, plan.data_offset, plan.lr_scale)
        if rollback.in_run_dir(g, self.run_dir):
            self.feed.flush(force_sync=True)
            if self.world.leader:  # one writer per file (every rank took the same decision)
                self.io.submit(rollback.write_companion, self.run_dir, plan.to_step, g.to_state(plan.to_step))
        else:  # the initial state, or an --init-from checkpoint elsewhere: write it here
            g.settle(ckpt.checkpoint_name(plan.to_step))
            await self.checkpoint(trainer, proxy, records, progress)
        dropped = (await loop.run_in_executor(self.io, rollback.drop_after, self.run_dir, plan.to_step)
                   if self.world.leader else [])
        if dropped:
            log.warning("guard: removed the abandoned timeline's checkpoints %s", ", ".join(dropped))
        self.writer.last_committed = plan.to_step
        return proxy, proxy.batch(plan.to_step)
