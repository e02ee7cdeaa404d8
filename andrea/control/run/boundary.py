"""The step boundary: what happens between two optimizer updates, in order, and the step pipeline around it.

`Boundary` holds the run's position — the header step S (updates completed), the configuration in force, the data
proxy and the next batch — and at each boundary (`cross`) does, in this order:
    1. act on requests and the cadence: under torchrun the ranks first share their requests (control/parallel/ranks.py);
       `boundary_action` (control/run/signals.py) decides checkpoint / stop / pivot;
    2. a due checkpoint: drain the step records through S (each one fed to the guard, the bandit, the ledger),
       fsync-flush the ledger, and unless the guard's gate is shut (control/guard/decisions.py `may_commit`) snapshot
       [w | m | v] into a free staging buffer and queue the commit on the I/O thread: ledger fsync, then
       `step_S.state.json`, `.state.json` and `step_S.guard.json` with one directory fsync, then the atomic `.bin`;
    3. an incident the guard declared: roll back to its known-good point (the files: control/guard/rollback.py), S goes
       back, and the boundary is crossed again from there;
    4. a pivot, once its checkpoint is taken (control/mixture/pivot.py archives after that commit, on the FIFO I/O thread);
    5. eval, sample and task audits when due (never at the step a process or a rollback started from: they ran in the
       timeline that first reached it);
    6. stop, or fail when a write error's policy says so.
Between boundaries `advance` launches step S + 1 on the training thread and meanwhile takes finished records and
draws the batch after it. Every decision is a pure function elsewhere; this class only sequences them and carries
them out through its collaborators: the trainer (its thread: snapshots, loads, audits), the checkpoint writer
(control/commit/writer.py, shards.py), the ledger feed (control/run/ledger_feed.py) and the I/O thread. What reacts
to an eval, a commit, a rollback, a pivot or the settled step subscribes to it (control/run/observers.py: the
guard's failed commits, the held-out history, the views, the replica, the notices, the plateau); control/run/runtime.py
builds the boundary with its observers once the run has started and wires it to the event loop.
Writes (through the I/O thread): `.loss.json` lines, the checkpoint companions and `.state.json`
(rundir/sidecars.py), `.samples.json`, `run.toml` after `micro_batch_size = "auto"` decided, and at a pivot or
rollback what control/mixture/pivot.py and control/guard/rollback.py document.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from functools import partial

import numpy as np

from andrea.errors import UserError
from andrea.evals import audit
from andrea.control.mixture import pivot
from andrea.control.parallel import agreement, ranks, sharing
from andrea.control.run import resume
from andrea.control.guard import rollback
from andrea.control.guard.decisions import INCIDENT, SUSPECT, advice
from andrea.control.mixture.proxy import Batch, DataProxy
from andrea.control.run.observers import GuardCommits, Observer, Observers
from andrea.control.run.records import StepRecord, StepRecords
from andrea.control.run.signals import Action, Requests, boundary_action
from andrea.control.run.started import Started
from andrea.control.observe import watchdog
from andrea.control.observe.progress import Progress
from andrea.rundir import atomic, checkpoint as ckpt, names, sidecars
from andrea.rundir.ledger import marker

log = logging.getLogger("andrea.control.run")


class RunFailed(UserError, RuntimeError):
    """The run stopped without the guarantee it owes (e.g. the final checkpoint could not be written)."""


def settled_point(committed: int | None, known_good: int | None) -> int | None:
    """The newest step no resume or rollback can go below: the newest checkpoint on disk (`committed`; a crash
    resumes there), and with the guard no later than its known-good point (a rollback returns there, not to a
    tentative checkpoint). A known-good point whose commit is still in flight is not yet on disk: a SIGKILL now
    resumes below it. None before any checkpoint."""
    if committed is None:
        return None
    return committed if known_good is None else min(committed, known_good)


class Boundary:
    """The run's position (header step S, the configuration in force, the data proxy, the next batch) and the
    sequence at each of its step boundaries. The collaborators come in the started run (control/run/started.py) and beside
    it, so the order can be tested with fakes (tests/unit/control/run/test_boundary.py)."""

    def __init__(self, run: Started, *, req: Requests, records: StepRecords, progress: Progress,
                 observers: Iterable[Observer] = (), evaluate: Callable = audit.evaluate,
                 sample: Callable = audit.sample_audits):
        self.cfg, self.run_dir, self.world = run.cfg, run.run_dir, run.world
        self.step, self.proxy = run.step, run.proxy
        self.start = run.step  # the audits of this step ran before: in the previous process, or the first timeline
        self.batch: Batch | None = None  # what the next update trains on (drawn while the previous one runs)
        self.trainer, self.writer, self.guard, self.feed = run.trainer, run.writer, run.guard, run.feed
        self.codec, self.tasks, self.meter = run.codec, run.tasks, run.meter
        self.train, self.io = run.train, run.io  # the training thread (the model's only user) and the FIFO I/O thread
        self.req, self.records, self.progress = req, records, progress
        # told of each eval, commit, rollback, pivot and settled step (control/run/observers.py): the guard's
        # failed commits and the held-out history first, then what the runtime subscribes (views, replica, notices)
        self.observers = Observers([GuardCommits(run.guard), run.heldout, *observers])
        self.evaluate, self.sample = evaluate, sample

    # --- the sequence ------------------------------------------------------------------------------------
    async def cross(self, stop_at: int) -> bool:
        """Everything due at the boundary of step S, in order; True when the run stops here."""
        if self.batch is None:
            self.batch = await asyncio.get_running_loop().run_in_executor(None, self.proxy.batch, self.step)
        action, taken = await self.requests_and_checkpoint(stop_at)  # 1 and 2
        # 3. An incident: back to the known-good step, whose boundary is crossed again from 1. Only this repeats:
        # each rollback is the guard's next attempt, and past guard.max_attempts `rollback` raises RunFailed (in
        # practice once: the good step is on disk, so its boundary commits nothing a rank check could refuse).
        while self.guard.pending is not None:
            await self.rollback()
            self.start = self.step
            if self.req.stop is not None:
                log.warning("%s during an incident: rolled back to %s, which is on disk; writing nothing more",
                            self.req.stop, self.guard.good["path"])
                return True
            action, taken = await self.requests_and_checkpoint(stop_at)
        if action.pivot and taken:  # 4. a pivot waits for its checkpoint (the guard may hold it back)
            await self.pivot()
        if self.step != self.start:  # 5. the audits
            await self.audit()
        self.observers.on_settle(self.settled_step())
        if action.stop:  # 6.
            return True
        if self.req.failed:
            raise RunFailed(self.req.failed)
        return False

    async def requests_and_checkpoint(self, stop_at: int) -> tuple[Action, bool]:
        """1 and 2: the requests shared and decided, the checkpoint taken when due; (the action, taken or none due)."""
        ck = self.cfg.checkpoint
        if self.writer.first_error and ck.on_write_error == "stop" and self.req.failed is None:
            self.req.failed = self.writer.first_error  # every rank exits at the boundary that shares it
        learned = ranks.share(self.world, self.req)
        if self.req.pivot and not self.world.shared_dir:  # separate disks: rank 0's policy, sent
            self.req.policy = ranks.leader_policy(self.world, self.req.policy, lambda: pivot.read_policy(
                self.run_dir / names.NEXT_POLICY_NAME, self.cfg))
            self.req.pivot = self.req.policy is not None
        elif learned:  # a hot pivot asked on rank 0: the same policy file
            self.req.policy = pivot.read_policy(self.run_dir / names.NEXT_POLICY_NAME, self.cfg)
        action = boundary_action(self.step, stop_at, ck.every, self.req)
        taken = True
        if action.checkpoint and self.writer.last_committed != self.step:
            taken = await self.checkpoint()
            if not taken and action.stop and self.req.stop is None:  # the step target held back: resolved
                self.guard.hold_target(self.step)  # as an incident (control/guard/decisions.py), never left short
        return action, taken

    def settled_step(self) -> int | None:
        """The newest step no resume or rollback can go below (settled_point)."""
        return settled_point(self.writer.last_committed, self.guard.good["step"] if self.cfg.guard.enabled else None)

    async def advance(self, run_step: Callable[[Batch], int]) -> None:
        """Step S + 1: `run_step(batch)` on the training thread (it pushes its record and returns the new header
        step) while this thread takes finished records and draws the batch after it."""
        loop = asyncio.get_running_loop()
        self.take_records(self.records.make_room())
        fut = loop.run_in_executor(self.train, run_step, self.batch)
        next_step = self.step + 1
        self.take_records(self.records.pop_ready(wait_until_step=self.proxy.cut_for(next_step)))
        self.batch = self.proxy.batch(next_step) if self.guard.pending is None else self.batch  # else: rolled back
        self.step = await fut
        if self.trainer.micro_batch_choice is not None:  # train.micro_batch_size = "auto" decided
            self.record_micro_batch()
        self.take_records(self.records.pop_ready())
        self.feed.flush()

    async def finish(self) -> list:
        """At the end, however it came: the last records, the ledger fsynced, every commit in flight landed."""
        self.progress.close()
        self.take_records(self.records.pop_ready(wait_until_step=self.step))
        self.feed.flush(force_sync=True)
        results = await self.writer.drain()
        self.feed.wait()
        if self.feed.ledger.backlog:
            raise RunFailed(f"{self.feed.ledger.path}: {self.feed.ledger.backlog} ledger lines could not be "
                            "written (disk full?); the last committed checkpoint precedes them")
        return results

    # --- records and the ledger ----------------------------------------------------------------------------
    def take_records(self, records: list[StepRecord]) -> None:
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
            self.proxy.observe(r.step, r.seq_losses)
            entry = {"step": r.step, "loss": r.loss, "lr": r.lr, "grad_norm": r.grad_norm,
                     "tokens": r.step * tokens_per_step, "time": round(time.time(), 3), "phase": self.proxy.phase}
            _, flops, utilisation = self.meter.observe(r.step, time.monotonic()) if self.meter else (None,) * 3
            if utilisation is not None:
                entry["mfu"] = round(utilisation, 5)
            self.feed.lines.append(entry)
            self.progress.update(r.step, r.loss, r.lr, flops=flops, mfu=utilisation)

    def record_micro_batch(self) -> None:
        """`micro_batch_size = "auto"` chose at its first step: a ledger marker, and run.toml holds the number (a
        resume reuses it instead of probing again)."""
        choice, self.trainer.micro_batch_choice = self.trainer.micro_batch_choice, None
        self.cfg.train.micro_batch_size = choice["micro_batch_size"]
        self.feed.lines.append(marker("micro_batch", self.step - 1, **choice))
        log.info("train.micro_batch_size=auto: %d rows per pass (of %d per step%s), recorded in run.toml",
                 choice["micro_batch_size"], choice["rows"], " per rank" if self.world.distributed else "")
        if self.world.leader:
            self.io.submit(atomic.write_atomic, self.run_dir / names.CONFIG_NAME, self.cfg.to_toml().encode())

    # --- checkpoints ---------------------------------------------------------------------------------------
    async def checkpoint(self) -> bool:
        """Take the checkpoint of step S unless the guard sees trouble; True if it was taken."""
        step, guard, writer = self.step, self.guard, self.writer
        self.take_records(self.records.pop_ready(wait_until_step=step))
        self.feed.flush(force_sync=True)
        if not guard.may_commit():  # never checkpoint (or let retention pass) over the last good state
            newest = writer.last_committed
            good = guard.where_good(names.checkpoint_name(newest) if newest is not None else None)
            why = "it is diverging" if guard.pending else f"the guard sees trouble ({guard.last_reason})"
            if self.req.stop is not None:
                log.warning("%s during an incident: writing nothing, %s; %s", self.req.stop, why, good)
            else:
                log.warning("not checkpointing step %d: %s; %s", step, why, good)
            return False
        if self.world.distributed and not await self.ranks_agree(step):
            return False  # an incident: the rollback follows (cross), the checkpoint is never written
        state = self.proxy.state(step)
        guard_state = guard.on_checkpoint(step, names.checkpoint_name(step))
        slot = await writer.free_slot()
        t0 = time.perf_counter()
        fence = await asyncio.get_running_loop().run_in_executor(self.train, self.trainer.snapshot,
                                                                 writer.staging[slot])
        writer.stall_seconds.append(time.perf_counter() - t0)

        def before_commit() -> None:  # on the I/O thread: what the `.bin` vouches for is durable before it
            self.feed.ledger.sync()
            state_json = sidecars.json_bytes(sidecars.seal(state))
            atomic.write_many({sidecars.checkpoint_state_path(self.run_dir, step): state_json,
                               self.run_dir / names.STATE_NAME: state_json,
                               rollback.companion_path(self.run_dir, step): rollback.companion_bytes(guard_state),
                               # the ledger as this checkpoint vouches for it: a later start checks it
                               names.companion_path(self.run_dir, step, "ledger"):
                                   self.feed.ledger.record_bytes()})

        commit = writer.start_commit(slot, step, fence, before_commit)
        self.observers.on_commit(step, commit, state, writer.stall_seconds[-1])
        if self.req.checkpoint_at is not None and step >= self.req.checkpoint_at:
            self.req.checkpoint_at, self.req.landing = None, step
            commit.add_done_callback(lambda _: setattr(self.req, "landing", None))
        return True

    async def ranks_agree(self, step: int) -> bool:
        """Under torchrun, before the checkpoint of S: every rank's digest of the weights it holds, compared
        (control/parallel/agreement.py). A disagreement is an incident: a `rank_mismatch` marker (and notice) and the
        guard's rollback to its known-good checkpoint, which the ranks agreed on; with the guard off, the run fails
        naming the newest checkpoint (every committed one was agreed on)."""
        digest = await asyncio.get_running_loop().run_in_executor(
            self.train, lambda: agreement.weights_digest(self.trainer.weights()))
        digests = self.world.gather(digest)
        odd = agreement.disagreement(digests)
        if not odd:
            return True
        agreed = next(r for r in range(len(digests)) if r not in odd)
        reason = (f"rank{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} of {len(digests)} hold weights "
                  f"that differ from the others' (xxh3 {digests[odd[0]][:16]}, the others {digests[agreed][:16]})")
        self.feed.lines.append(marker("rank_mismatch", step, ranks=odd, digests=digests))
        newest = self.writer.last_committed
        log.error("step %d: %s; not checkpointing it", step, reason)
        if not self.cfg.guard.enabled:
            raise RunFailed(f"step {step}: the ranks disagree on the weights ({reason}); resume from "
                            f"{names.checkpoint_name(newest) if newest is not None else 'the start'}, which they "
                            "agreed on")
        self.guard.declare(step, f"the ranks disagree on the weights: {reason}")
        return False

    # --- pivots (docs/operating.md) ----------------------------------------------------------------------------------
    async def pivot(self) -> None:
        """At the pivot checkpoint: the archive, queued after that checkpoint's commit on the FIFO I/O thread and
        awaited, then a new phase under the new policy, drawn from the same step."""
        step, phase = self.step, self.proxy.phase + 1
        new_cfg = pivot.at_step(self.req.policy, step)  # a pending anneal starts at this step
        self.req.pivot, self.req.policy = False, None
        self.feed.flush(force_sync=True)

        def archive() -> None:
            if not self.world.leader:  # rank 0 archives; the other ranks only change policy
                return
            self.feed.ledger.append([pivot.apply_pivot(self.run_dir, new_cfg, step, phase)])
            self.feed.ledger.sync()
            (self.run_dir / names.NEXT_POLICY_NAME).unlink(missing_ok=True)

        await asyncio.get_running_loop().run_in_executor(self.io, archive)
        self.cfg = self.trainer.cfg = new_cfg  # the trainer's lr follows an anneal from the step it trains next
        log.warning("pivot at step %d: phase %d under caps %s floors %s", step, phase, new_cfg.policy.caps,
                    new_cfg.policy.floors)
        self.proxy = DataProxy(new_cfg, self.proxy.arms, phase=phase, phase_start=step)
        self.guard.pivot(step, names.checkpoint_name(step))
        self.proxy.data_offset = self.guard.remedy["data_offset"]
        self.observers.on_pivot(step, phase, new_cfg)
        self.batch = self.proxy.batch(step)

    # --- audits --------------------------------------------------------------------------------------------
    async def audit(self) -> None:
        """Validation loss and sample audits at their cadences (never at step 0)."""
        if not self.world.leader:  # rank 0 audits; the ledger and .samples.json are its alone
            return
        loop, step, cfg = asyncio.get_running_loop(), self.step, self.cfg
        if step > 0 and step % cfg.train.eval_every == 0:
            losses = await loop.run_in_executor(self.train, partial(self.evaluate, self.trainer, self.proxy.arms, cfg,
                                                                    beat=watchdog.heartbeat))
            val = sum(losses.values()) / len(losses)
            target = audit.target_loss(losses, dict(zip(self.proxy.names, self.proxy.policy.target_weights())))
            self.feed.lines.append(marker("eval", step, val_loss=val, target_loss=target, arms=losses))
            self.observers.on_eval(step, val)
            log.info("step %d val_loss %.4f (%s)", step, val, ", ".join(f"{k} {v:.3f}" for k, v in losses.items()))
        every = cfg.sample.every or cfg.checkpoint.every
        if step > 0 and step % every == 0 and self.codec is not None and cfg.sample.prompts:
            audits = await loop.run_in_executor(self.train, self.sample, self.trainer, self.codec, cfg, step)
            if audits:  # none from a model that cannot be sampled (evals/audit.py)
                self.io.submit(self._write_audits, audits)
        if self.tasks is not None and step > 0 and step % (cfg.eval.every or cfg.checkpoint.every) == 0:
            score = await loop.run_in_executor(self.train, partial(self.tasks, self.trainer, beat=watchdog.heartbeat))
            self.feed.lines.append(marker("tasks", step, **score))
            log.info("step %d tasks %s: acc %.4f acc_norm %.4f (%d examples)", step, score["tasks"], score["acc"],
                     score["acc_norm"], score["examples"])

    async def abandon_after(self, step: int) -> list[str]:
        """The abandoned timeline's checkpoints (above `step`): deleted on rank 0's disk after the FIFO I/O thread's
        earlier work; then the observers are told (the replica unpublishes them at its next pass, their evals leave
        the held-out history). Returns the names deleted."""
        dropped = (await asyncio.get_running_loop().run_in_executor(self.io, rollback.drop_after, self.run_dir, step)
                   if self.world.leader else [])
        self.observers.on_rollback(step)
        return dropped

    def _write_audits(self, audits: list[dict]) -> None:
        try:
            sidecars.append_audit(self.run_dir, audits, self.cfg.sample.keep)
        except OSError as e:  # an audit is worth a warning, never the run
            log.error("%s: sample audit of step %d not written: %s", names.SAMPLES_NAME, audits[0]["step"], e)

    # --- the guard's rollback (decisions: control/guard/decisions.py; files: control/guard/rollback.py) -------------------------
    async def rollback(self) -> None:
        """Back to the known-good point with the planned remedy, made durable before training goes on.

        Order on the I/O thread (FIFO): ledger markers (fsynced), the good point's guard companion (or the good
        state committed as a checkpoint when it is not one in this directory), then the abandoned timeline's
        checkpoints deleted. A crash anywhere in between resumes from a checkpoint whose replay takes the same
        decisions again.
        """
        loop, g, trainer = asyncio.get_running_loop(), self.guard, self.trainer
        self.records.pop_ready(wait_until_step=1 << 62)  # in flight after the incident: dropped
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
            await self.abandon_after(plan.to_step)
            raise RunFailed(plan.message(start_from, advice(self.cfg.train.optimizer, self.cfg.train.grad_clip)))
        payload = await sharing.payload_everywhere(  # on separate disks: read by rank 0, sent to the others
            self.world, lambda: rollback.good_payload(g, self.run_dir, self.cfg, trainer), trainer.n, self.train)
        await loop.run_in_executor(self.train, trainer.load, payload)
        g.apply(plan)
        self.step, trainer.lr_scale = plan.to_step, plan.lr_scale
        if self.meter is not None:  # the steps replayed from G are not a rate over the ones abandoned
            self.meter.reset()
        info = ckpt.CheckpointInfo(self.run_dir / names.checkpoint_name(plan.to_step), plan.to_step, trainer.n)
        self.proxy = resume.restore_proxy(self.cfg, self.run_dir, self.proxy.arms, info,
                                          sharing.json_reader(self.world))
        self.proxy.data_offset = plan.data_offset
        self.feed.lines.append(marker("rollback", plan.to_step, checkpoint=plan.to_path or "initial state",
                                      attempt=plan.attempt, remedy=plan.remedy, data_offset=plan.data_offset,
                                      lr_scale=plan.lr_scale, **{"from": plan.incident_step}))
        log.warning("guard: rolled back from step %d to %s (attempt %d of %d: %s; data offset %d, lr scale %g)",
                    plan.incident_step, plan.to_path or "the initial state", plan.attempt, self.cfg.guard.max_attempts,
                    plan.remedy, plan.data_offset, plan.lr_scale)
        if sharing.from_leader(self.world, rollback.in_run_dir, g, self.run_dir):
            self.feed.flush(force_sync=True)
            if self.world.leader:  # one writer per file (every rank took the same decision)
                self.io.submit(rollback.write_companion, self.run_dir, plan.to_step, g.to_state(plan.to_step))
        else:  # the initial state, or an --init-from checkpoint elsewhere: write it here
            g.settle(names.checkpoint_name(plan.to_step))
            await self.checkpoint()
        dropped = await self.abandon_after(plan.to_step)
        if dropped:
            log.warning("guard: removed the abandoned timeline's checkpoints %s", ", ".join(dropped))
        self.writer.last_committed = plan.to_step
        self.batch = self.proxy.batch(plan.to_step)
