"""The step boundary's sequencing (control/run/boundary.py) with a fake trainer and a fake writer: no processes, no model.

The fake trainer's state is a flat [w | m | v] of a few floats whose every element counts the updates applied since
the state it was loaded from, so a checkpoint's bytes say which state it holds. The fake writer commits through
`commit_checkpoint` on a real single-thread I/O executor, after `before_commit`, and every side effect
(ledger appends and fsyncs, snapshots, loads, commits) lands in one ordered event list. The guard, the data proxy,
the requests and `boundary_action` are the real ones: these tests check the order in which the boundary asks and
acts, not the decisions themselves (tests/unit/control/guard/test_decisions.py, test_requests.py and test_bandit.py do).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from andrea.config import schema as config, load as configload
from andrea.control.guard import rollback
from andrea.control.run.boundary import Boundary, RunFailed
from andrea.control.guard.decisions import Guard
from andrea.control.run.heldout import HeldOut
from andrea.control.run.ledger_feed import LedgerFeed
from andrea.control.run.observers import ToNotices, ToReplica, ToViews
from andrea.control.mixture.proxy import DataProxy
from andrea.control.run.records import StepRecords
from andrea.control.run.signals import Requests
from andrea.control.run.started import Started
from andrea.control.parallel.distributed import World
from andrea.data.store import ArmTokens
from andrea.control.observe import watchdog
from andrea.control.observe.progress import Progress
from andrea.rundir import checkpoint as ckpt, names, sidecars
from andrea.rundir.checkpoint_write import commit_checkpoint
from andrea.rundir.retention import Policy, Retention
from andrea.control.run.trainer import StepOutput
from tests.sharding import run_ranks

N = 6  # parameters of the fake model


class Ledger:
    """LossLedger's surface: appends and fsyncs become events."""

    backlog = 0

    def __init__(self, events: list, path: Path):
        self.events, self.path, self.lines = events, path, []

    def append(self, lines: list[dict]) -> None:
        self.lines += lines
        self.events += [("line", line.get("event", "step"), line["step"]) for line in lines]

    def sync(self) -> None:
        self.events.append(("sync",))

    def seal(self) -> dict:
        steps = [line["step"] for line in self.lines if "event" not in line]
        return {"lines": len(self.lines), "last_step": steps[-1] if steps else None}

    def record_bytes(self) -> bytes:
        return json.dumps(self.seal()).encode()


class Trainer:
    """The trainer's surface the boundary uses; `run_step` is what runtime's `_step` does on the training thread."""

    def __init__(self, events: list, records: StepRecords, nan_at: set[int] = frozenset()):
        self.n, self.events, self.records = N, events, records
        self.state = torch.zeros(3 * N)  # (3n,) [w | m | v]
        self.lr_scale, self.micro_batch_choice = 1.0, None
        self.nan_at = set(nan_at)  # header steps whose loss reads NaN, once each (the ANDREA_TEST_POISON_STEPS hook)

    def run_step(self, batch) -> int:
        self.state += 1
        loss = float("nan") if batch.step + 1 in self.nan_at else 2.0
        self.nan_at.discard(batch.step + 1)
        rows = batch.x.shape[0]
        self.records.push(StepOutput(batch.step + 1, 1e-3, torch.tensor(loss), torch.tensor(1.0),
                                     torch.full((rows,), 2.0)))
        return batch.step + 1

    def weights(self) -> torch.Tensor:
        return self.state[:N]

    def snapshot(self, staging: torch.Tensor) -> None:
        staging.copy_(self.state)
        self.events.append(("snapshot", int(self.state[0])))

    def load(self, payload: torch.Tensor) -> None:
        self.state.copy_(payload)
        self.events.append(("load", int(self.state[0])))


class Writer:
    """CheckpointWriter's surface: two staging slots, commits on the I/O thread after `before_commit`."""

    def __init__(self, run_dir: Path, io, events: list, fail: set[int] = frozenset(), writes: bool = True,
                 hold: dict[int, threading.Event] | None = None):
        self.run_dir, self.io, self.events, self.fail = run_dir, io, events, set(fail)
        self.hold = hold or {}  # step -> an event its commit waits on (a slow disk), on the I/O thread
        self.writes = writes  # False: a rank > 0 on its own disk (control/commit/gathered.py), which writes nothing
        self.staging = [torch.zeros(3 * N) for _ in range(2)]
        self.last_committed, self.first_error = None, None
        self.stall_seconds: list[float] = []
        self._busy: list = []

    async def free_slot(self) -> int:
        return len(self._busy) % 2

    def start_commit(self, slot, step, fence, before_commit):
        payload = self.staging[slot].numpy().copy()

        def commit():
            if step in self.hold:
                assert self.hold[step].wait(30), f"step {step}'s commit held for 30 s"
            if not self.writes:
                self.events.append(("commit", step, None))
                return SimpleNamespace(step=step, path=None, error=None)
            before_commit()
            companions = all(p.exists() for p in (sidecars.checkpoint_state_path(self.run_dir, step),
                                                  self.run_dir / f"step_{step:06d}.guard.json"))
            self.events.append(("commit", step, companions))
            if step in self.fail:
                return SimpleNamespace(step=step, path=None, error=f"step_{step:06d}.bin: checkpoint write failed")
            return SimpleNamespace(step=step, path=commit_checkpoint(self.run_dir, step, payload), error=None)

        fut = asyncio.get_running_loop().run_in_executor(self.io, commit)
        fut.add_done_callback(self._finished)
        self._busy.append(fut)
        return fut

    def _finished(self, fut) -> None:
        result = fut.result()
        if result.error:  # as CheckpointWriter: the first failure since the newest success
            self.first_error = self.first_error or result.error
        else:
            self.last_committed, self.first_error = max(result.step, self.last_committed or 0), None

    async def drain(self) -> list:
        return list(await asyncio.gather(*self._busy))


def make_cfg(**sections) -> config.RunConfig:
    cfg = configload.load(preset="andrea-tiny")
    cfg.train.eval_every = 10_000
    cfg.sample.prompts = []
    cfg.guard = dataclasses.replace(cfg.guard, confirm_steps=5, persist_window=5)
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(cfg, section), key, value)
    return cfg


def make_boundary(tmp_path: Path, cfg: config.RunConfig, *, step: int = 0, nan_at=(), fail=(), writes: bool = True,
                  world: World | None = None, hold=None, **kw) -> Boundary:
    events: list = []
    io = ThreadPoolExecutor(1)
    train = ThreadPoolExecutor(1)
    records = StepRecords(64, cfg.train.batch_size, torch.device("cpu"))
    rng = np.random.default_rng(0)
    arms = [ArmTokens(name, rng.integers(0, cfg.model.vocab_size, 20_000).astype(np.uint16),
                      rng.integers(0, cfg.model.vocab_size, 2_000).astype(np.uint16)) for name in cfg.data.arms]
    trainer = Trainer(events, records, set(nan_at))
    trainer.state += step
    ledger = Ledger(events, tmp_path / ".loss.json")
    run = Started(cfg=cfg, run_dir=tmp_path, world=world or World(), step=step, trainer=trainer,
                  proxy=DataProxy(cfg, arms, phase_start=step), writer=Writer(tmp_path, io, events, set(fail), writes, hold),
                  guard=Guard(cfg.guard, good_step=step), ledger=ledger, feed=LedgerFeed(ledger, io), codec=None,
                  tasks=None, meter=None, train=train, io=io, heldout=HeldOut(),
                  retention=Retention(Policy(cfg.checkpoint.keep_last, cfg.checkpoint.keep_every)))
    b = Boundary(run, req=Requests(), records=records, progress=Progress(step, 10_000, 1, 10_000), **kw)
    b.events = events
    return b


async def drive(b: Boundary, stop_at: int, on_step=None, run_step=None) -> None:
    """runtime.TrainingRun.loop, without the process around it; `on_step(b)` after each step's boundary work."""
    try:
        while not await b.cross(stop_at):
            await b.advance(run_step or b.trainer.run_step)
            if on_step is not None:
                on_step(b)
    finally:
        await b.finish()
        b.io.shutdown(wait=True)
        b.train.shutdown(wait=True)


def weights_of(run_dir: Path, step: int) -> float:
    _, payload = ckpt.read_payload(run_dir / names.checkpoint_name(step), N)
    return float(payload[0])


def test_a_checkpoint_lands_after_its_ledger_lines_are_fsynced_and_its_companions_written(tmp_path):
    b = make_boundary(tmp_path, make_cfg(checkpoint={"every": 5}))
    asyncio.run(drive(b, 12))
    commits = [e for e in b.events if e[0] == "commit"]
    assert [c[1] for c in commits] == [5, 10, 12]  # the cadence, then the final step
    assert all(companions for _, _, companions in commits)
    for _, step, _ in commits:
        at = b.events.index(("commit", step, True))
        line = b.events.index(("line", "step", step))
        assert line < at and ("sync",) in b.events[line:at]  # the line it vouches for, durable first
        assert weights_of(tmp_path, step) == step  # the snapshot of step S, not a later state
    assert b.step == 12 and b.writer.last_committed == 12
    assert sidecars.read_json(tmp_path / names.STATE_NAME)["step"] == 12


class SettleViews:
    """The views' surface (control/observe/views.py): each settle recorded beside the newest checkpoint on disk then."""

    def __init__(self):
        self.writer, self.settles = None, []

    def settle(self, step):
        self.settles.append((step, self.writer.last_committed))

    def add_records(self, lines): ...
    def add_checkpoint(self, step, state, stall_s): ...
    def on_commit(self, fut): ...


def test_the_views_never_settle_a_step_past_the_newest_checkpoint_on_disk(tmp_path):
    # Step 5's checkpoint is known-good at step 10 (confirm_steps=5), but its commit lands only at step 14: until
    # then a SIGKILL resumes from the start, and W&B must not yet have shown steps that run would supersede.
    slow = threading.Event()
    views = SettleViews()
    b = make_boundary(tmp_path, make_cfg(checkpoint={"every": 5}), hold={5: slow}, observers=[ToViews(views)])
    views.writer = b.writer
    seen_good = []

    def on_step(b):
        seen_good.append(b.guard.good["step"])
        if b.step == 14:
            slow.set()
            b.io.submit(lambda: None).result(30)  # the FIFO I/O thread: past this, the held commit has returned

    asyncio.run(drive(b, 20, on_step))
    assert 5 in seen_good[:13]  # the known-good point moved to 5 while its commit was held
    assert all(step is None or (on_disk is not None and step <= on_disk) for step, on_disk in views.settles)
    assert max(step for step, _ in views.settles if step is not None) >= 10  # and settling went on once it landed


def test_a_stop_request_checkpoints_the_step_it_arrives_in_and_stops_there(tmp_path):
    b = make_boundary(tmp_path, make_cfg(checkpoint={"every": 100}))

    def step(batch):  # on the training thread, as a signal arrives while step 3 runs
        if batch.step == 2:
            b.req.stop = "SIGTERM"
        return b.trainer.run_step(batch)

    asyncio.run(drive(b, 1_000, run_step=step))
    assert b.step == 3 and [e[1] for e in b.events if e[0] == "commit"] == [3]


def test_a_non_finite_step_shuts_the_gate_and_the_rollback_reloads_the_known_good_state(tmp_path, monkeypatch):
    class Replicator:  # control/replica/replicator.py as the boundary sees it: told of commits and of the rollback
        def notify(self, *_) -> None:
            pass

        def supersede(self, step: int) -> None:
            b.events.append(("supersede", step))
    b = make_boundary(tmp_path, make_cfg(checkpoint={"every": 5, "keep_last": 10}), nan_at={12},
                      observers=[ToReplica(Replicator())])
    for name in ("write_companion", "drop_after"):  # the rollback's file side, observed in the event order
        real = getattr(rollback, name)

        def observed(run_dir, step, *args, _real=real, _name=name):
            result = _real(run_dir, step, *args)
            b.events.append((_name, step, result))
            return result

        monkeypatch.setattr(rollback, name, observed)
    asyncio.run(drive(b, 20))
    incident = b.events.index(("line", "incident", 12))
    assert all(e[1] < 12 for e in b.events[:incident] if e[0] == "commit")  # the gate shut at the NaN
    rolled = next(e for e in b.events if e[:2] == ("line", "rollback"))
    to_step, at = rolled[2], b.events.index(rolled)
    assert incident < at and to_step < 12
    assert ("load", to_step) in b.events  # the known-good checkpoint's state, read back from its file
    companion = b.events.index(("write_companion", to_step, None))
    drop = b.events.index(next(e for e in b.events if e[0] == "drop_after"))
    assert at < companion < drop and ("sync",) in b.events[at:companion]  # markers durable, then the files
    abandoned = [names.checkpoint_name(e[1]) for e in b.events[:incident] if e[0] == "commit" and e[1] > to_step]
    assert b.events[drop] == ("drop_after", to_step, abandoned) and abandoned  # the timeline that led there
    assert b.events.index(("supersede", to_step)) > drop  # and the replica drops it too
    # training went on from the good state: step 20's weights count exactly 20 updates since the start
    assert b.step == 20 and weights_of(tmp_path, 20) == 20


def test_a_pivot_waits_for_its_checkpoint_and_takes_the_new_policy_after_the_commit(tmp_path):
    cfg = make_cfg(checkpoint={"every": 100, "usr1": "step"})
    b = make_boundary(tmp_path, cfg)
    new = configload.from_dict({**cfg.to_dict(), "policy": {"caps": {cfg.data.arms[0]: 0.2}}})
    gate = {"open": False}
    b.guard.may_commit = lambda: gate["open"]  # the guard holds the pivot's checkpoint back at first

    def ask_then_open(b):
        if b.step == 1:
            b.req.policy = new
            b.req.ask_pivot(b.step, cfg.checkpoint.every, cfg.checkpoint.usr1)  # due at step 2
        if b.step == 3:
            gate["open"] = True  # step 3's boundary: the checkpoint, then the pivot

    asyncio.run(drive(b, 6, on_step=ask_then_open))
    pivot = b.events.index(next(e for e in b.events if e[:2] == ("line", "pivot")))
    assert b.events[pivot][2] == 3
    assert b.events.index(("commit", 3, True)) < pivot  # archived only after the pivot checkpoint landed
    assert b.proxy.phase == 1 and b.proxy.phase_start == 3 and b.cfg.policy.caps == {cfg.data.arms[0]: 0.2}
    assert b.req.pivot is False and b.req.policy is None
    assert (tmp_path / "archive" / "phase-0").is_dir()


def test_audits_run_at_their_cadence_but_never_at_the_step_a_process_starts_from(tmp_path):
    cfg = make_cfg(checkpoint={"every": 100}, train={"eval_every": 5})
    seen = []

    def evaluate(trainer, arms, cfg, beat):
        assert beat is watchdog.heartbeat  # progress inside the eval reaches the watchdog (an eval > floor_s)
        seen.append(int(trainer.state[0]))
        return {a.name: 1.0 for a in arms}

    b = make_boundary(tmp_path, cfg, step=10, evaluate=evaluate)
    asyncio.run(drive(b, 20))
    assert seen == [15, 20]  # step 10's eval ran in the process that reached it first
    assert [e[2] for e in b.events if e[:2] == ("line", "eval")] == [15, 20]


def test_a_failed_write_under_on_write_error_stop_fails_the_run_at_a_boundary(tmp_path):
    # The disk stays full from step 4 on: a later successful commit would clear the error (the retry policy's
    # recovery), and whether one lands before the next boundary is timing.
    b = make_boundary(tmp_path, make_cfg(checkpoint={"every": 4, "on_write_error": "stop"}),
                      fail=set(range(4, 1_001, 4)))
    with pytest.raises(RunFailed, match="step_000004.bin: checkpoint write failed"):
        asyncio.run(drive(b, 1_000))
    assert b.req.failed is not None and 4 < b.step < 1_000
    assert not (tmp_path / names.checkpoint_name(4)).exists()


def test_on_separate_disks_rank_1_takes_rank_0s_rollback_state_and_policy_and_never_touches_its_disk(tmp_path):
    """Two ranks as threads, each with its own run directory; rank 1's writer writes nothing (the gathered commit).
    The rollback's checkpoint and sidecars, and the pivot's policy, exist on rank 0's disk alone."""
    cfg = make_cfg(checkpoint={"every": 5, "keep_last": 10, "usr1": "step"})
    new = configload.from_dict({**cfg.to_dict(), "policy": {"caps": {cfg.data.arms[0]: 0.2}}})
    disks = [tmp_path / "node0", tmp_path / "node1"]
    for d in disks:
        d.mkdir()

    def rank(world):
        world.shared_dir, world.view = False, world.rank
        b = make_boundary(disks[world.rank], make_cfg(checkpoint={"every": 5, "keep_last": 10, "usr1": "step"}),
                          nan_at={12}, writes=world.leader, world=world)

        def ask(b):  # `andrea pivot` reaches rank 0 alone, which read the policy from its own disk
            if b.step == 16 and world.leader:
                b.req.policy = new
                b.req.ask_pivot(b.step, cfg.checkpoint.every, cfg.checkpoint.usr1)

        asyncio.run(drive(b, 20, on_step=ask))
        return b

    got = run_ranks(2, rank)
    b0, b1 = got[0], got[1]
    assert isinstance(b0, Boundary) and isinstance(b1, Boundary), (b0, b1)
    rolled = [next(e for e in b.events if e[:2] == ("line", "rollback")) for b in (b0, b1)]
    assert rolled[0] == rolled[1] and ("load", rolled[0][2]) in b1.events  # rank 0's state, sent
    assert [e for e in b0.events if e[0] == "load"] == [e for e in b1.events if e[0] == "load"]
    assert b0.cfg.policy.caps == b1.cfg.policy.caps == {cfg.data.arms[0]: 0.2}
    assert b0.proxy.phase_start == b1.proxy.phase_start == 17 and b0.step == b1.step == 20
    assert list(disks[1].iterdir()) == []  # rank 1 read and wrote nothing on its own disk
    assert weights_of(disks[0], 20) == 20


def test_a_failed_write_and_a_pivot_are_notices(tmp_path):
    sent = []
    cfg = make_cfg(checkpoint={"every": 4, "usr1": "step"})
    b = make_boundary(tmp_path, cfg, fail={4},
                      observers=[ToNotices(lambda kind, step, **detail: sent.append((kind, step, detail)))])
    new = configload.from_dict({**cfg.to_dict(), "policy": {"caps": {cfg.data.arms[0]: 0.2}}})

    def ask(b):
        if b.step == 5:
            b.req.policy = new
            b.req.ask_pivot(b.step, cfg.checkpoint.every, cfg.checkpoint.usr1)  # due at step 6

    asyncio.run(drive(b, 8, on_step=ask))
    assert [(kind, step) for kind, step, _ in sent] == [("write_error", 4), ("pivot", 6)]
    assert "step_000004.bin" in sent[0][2]["error"] and sent[0][2]["disk_full"] is False
    assert sent[1][2]["phase"] == 1 and sent[1][2]["caps"] == {cfg.data.arms[0]: 0.2}


def test_a_step_target_the_gate_holds_back_is_rolled_back_and_trained_again_to_its_checkpoint(tmp_path):
    """Issue 46: the gate shut at the step target used to end the run there, exit 0, without the final checkpoint
    (for good: a restart replays the same steps into the same gate). Now it is an incident: a rollback to the
    known-good checkpoint with the data skipped, trained again to the target, whose checkpoint lands."""
    b = make_boundary(tmp_path, make_cfg(checkpoint={"every": 5, "keep_last": 10}))
    open_gate = b.guard.may_commit
    held = []

    def gate() -> bool:  # the guard sees trouble at the first arrival at the target only
        if b.step == 12 and not held:
            held.append(b.step)
            b.guard.last_reason = "grad norm 9 above its band 3"
            return False
        return open_gate()

    b.guard.may_commit = gate
    asyncio.run(drive(b, 12))
    assert held == [12]
    incident = next(e for e in b.events if e[:2] == ("line", "incident"))
    rolled = next(e for e in b.events if e[:2] == ("line", "rollback"))
    assert incident[2] == 12 and rolled[2] == 5  # the known-good checkpoint (confirmed 5 steps after it)
    assert b.events.index(incident) < b.events.index(rolled) < b.events.index(("commit", 12, True))
    assert b.step == 12 and b.writer.last_committed == 12 and (tmp_path / names.checkpoint_name(12)).exists()
    assert b.proxy.data_offset == 7  # the batches that led into it skipped, as at any incident
