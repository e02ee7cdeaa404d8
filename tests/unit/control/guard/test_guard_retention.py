"""The guard's part in retention: the real CheckpointWriter (control/commit/writer.py) in a temporary directory, told
by a Guard (control/guard/decisions.py) fed plain records which steps it protects. No training, no processes: the same
files survive on every machine.

The case it pins (issue #28, item 4): keep_last = 1 and no major checkpoints, the known-good checkpoint G and a
newer tentative one C. Retention alone would delete G as soon as C lands; a divergence before C is confirmed
must still find G on disk.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from andrea.config.keepers import GuardConfig
from andrea.control.guard.decisions import INCIDENT, Guard
from andrea.control.commit.writer import CheckpointWriter
from andrea.rundir import checkpoint as ckpt, names
from andrea.rundir.retention import Policy, Retention

N = 64  # parameters per checkpoint: 8 + 12·64 bytes, enough to tell the files apart
HEALTHY = (5.0, 1.0)  # (loss, grad norm): a flat healthy record, never anomalous


def payload(step: int) -> np.ndarray:
    """[w | m | v] of a checkpoint, recognisable by its step (v >= 0 as the format requires)."""
    return np.full(3 * N, float(step), dtype=np.float32)


class Run:
    """A Guard and a CheckpointWriter wired as control/run/runtime.py wires them (the guard spares its steps in the
    run's one retention policy, handed to the writer),
    stepped by hand: `records(a, b)` feeds healthy records a..b, `commit(s)` commits step s through the gate."""

    def __init__(self, run_dir, cfg: GuardConfig, *, wired: bool = True):
        self.run_dir, self.guard = run_dir, Guard(cfg)
        self.io = ThreadPoolExecutor(1)
        retention = Retention(Policy(keep_last=1))
        if wired:
            retention.spare("guard", self.guard.protected)
        self.writer = CheckpointWriter(run_dir, N, torch.device("cpu"), self.io, retention=retention)

    def records(self, first: int, last: int) -> None:
        for step in range(first, last + 1):
            assert self.guard.observe(step, *HEALTHY) != INCIDENT

    def commit(self, step: int) -> None:
        assert self.guard.may_commit(), f"the gate refused step {step}"
        self.guard.on_checkpoint(step, names.checkpoint_name(step))

        async def go():
            self.writer.staging[0].copy_(torch.from_numpy(payload(step)))
            result = await self.writer.start_commit(0, step, None)
            assert result.error is None, result.error

        asyncio.run(go())

    def on_disk(self) -> list[int]:
        return [s for s, _ in ckpt.list_checkpoints(self.run_dir)]

    def close(self) -> None:
        self.io.shutdown(wait=True)


@pytest.fixture
def make_run(tmp_path):
    made = []

    def make(confirm_steps: int, wired: bool = True) -> Run:
        made.append(Run(tmp_path, GuardConfig(confirm_steps=confirm_steps), wired=wired))
        return made[-1]

    yield make
    for r in made:
        r.close()


def test_keep_last_1_never_deletes_the_known_good_or_a_tentative_checkpoint(make_run):
    run = make_run(confirm_steps=15)  # longer than the cadence of 10: two checkpoints wait for confirmation
    run.records(1, 10)
    run.commit(10)
    run.records(11, 20)
    run.commit(20)
    assert run.guard.good["step"] == 0 and run.on_disk() == [10, 20]  # 10 is tentative: it may become good
    run.records(21, 25)  # 15 quiet records after 10: confirmed
    assert run.guard.good["step"] == 10
    run.records(26, 30)
    run.commit(30)
    assert run.on_disk() == [10, 20, 30]  # keep_last = 1 alone would leave [30]
    run.records(31, 35)  # 20 is confirmed; 10 is released to retention, which acts at the next commit
    assert run.guard.good["step"] == 20 and run.guard.protected() == {20, 30}
    run.records(36, 40)
    run.commit(40)
    assert run.on_disk() == [20, 30, 40]


def g_then_c(run: Run) -> None:
    """The known-good G = 10 (confirm_steps = 5), then the tentative C = 20 lands: retention's moment."""
    run.records(1, 10)
    run.commit(10)
    run.records(11, 15)
    assert run.guard.good["step"] == 10
    run.records(16, 20)
    run.commit(20)


def test_a_divergence_before_the_newer_checkpoint_is_confirmed_rolls_back_to_a_file_that_is_there(make_run):
    run = make_run(confirm_steps=5)
    g_then_c(run)
    assert run.on_disk() == [10, 20]
    run.records(21, 23)
    assert run.guard.observe(24, float("nan"), 1.0) == INCIDENT
    plan = run.guard.plan()
    assert (plan.to_step, plan.to_path) == (10, "step_000010.bin")
    step, data = ckpt.read_payload(run.run_dir / plan.to_path, N)
    assert step == 10 and np.array_equal(data, payload(10))


def test_without_the_guards_protection_retention_deletes_the_known_good_checkpoint(make_run):
    """The control: the same commits with the writer not told what the guard protects lose the rollback's
    target, which is what the test above would meet if the wiring were broken."""
    run = make_run(confirm_steps=5, wired=False)
    g_then_c(run)
    assert run.guard.good["step"] == 10 and run.on_disk() == [20]


def test_a_checkpoint_whose_commit_failed_never_becomes_the_known_good_point(make_run):
    """Commit 10 lands, commit 20 fails (a full disk): 20 is not on disk, so it must never be confirmed; else
    retention releases 10 and a rollback finds nothing to read."""
    run = make_run(confirm_steps=5)
    run.records(1, 10)
    run.commit(10)
    run.records(11, 20)
    assert run.guard.good["step"] == 10
    run.guard.on_checkpoint(20, names.checkpoint_name(20))  # the gate opened, the write then failed
    run.guard.on_commit_failed(20)
    run.records(21, 30)
    assert run.guard.good["step"] == 10 and 10 in run.guard.protected() and 20 not in run.guard.protected()


def test_the_boundary_tells_the_guard_of_a_failed_commit():
    """The guard's subscription to the boundary's commits (control/run/observers.py `GuardCommits`, which every
    Boundary subscribes first): a landed commit stays a candidate, a failed one is dropped."""
    from types import SimpleNamespace

    from andrea.control.run.observers import GuardCommits
    guard = Guard(GuardConfig(confirm_steps=5))
    observer = GuardCommits(guard)
    guard.on_checkpoint(20, names.checkpoint_name(20))
    loop = asyncio.new_event_loop()

    async def commit(error):
        fut = loop.create_future()
        observer.on_commit(20, fut, {}, 0.0)
        fut.set_result(SimpleNamespace(error=error))
        await asyncio.sleep(0)  # the done-callbacks run on the loop
    try:
        loop.run_until_complete(commit(None))
        assert [t["step"] for t in guard.tentative] == [20]
        loop.run_until_complete(commit("step_000020.bin: checkpoint write failed: No space left on device"))
        assert guard.tentative == []
    finally:
        loop.close()
