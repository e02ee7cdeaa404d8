"""The 2026 recipe's optimizer end to end: model.arch = modern with train.optimizer = muon, real `python -m andrea`
processes (and torchrun's 2 gloo ranks) on the tiny preset. What the GPT + AdamW promises, Muon keeps: a SIGKILL
and a resume end in the bytes of a run that never stopped, and so do a replica's restore and a resume from it
(checksums verified on the way); two ranks (ZeRO-1 with whole matrices per rank, micro-batches) follow one process
within the documented tolerance and resume bit for bit; the guard rolls a Muon run back and it heals. The same for
NorMuon on wsd with the value embeddings and smear: the modern presets' recipe."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from andrea.rundir import checkpoint as ckpt, names
from andrea.rundir.ledger import history
from tests.runs import ROOT, Trainer, andrea, andrea_here, env, launcher_argv, ledger, seed_data, train, wait_until
from tests.sharding import LOSS_RTOL, NORM_AT_START, NORM_RTOL

TARGET = 20
RECIPE = ["--set", "model.arch=modern", "--set", "train.optimizer=muon", "--checkpoint-every", "5"]
QUIET = ["--set", "sample.every=1000", "--set", "train.eval_every=1000"]
MICRO = ["--set", "train.micro_batch_size=2"]  # 2 rows a pass: 4 passes in one process, 2 per rank on two


def checkpoints(run_dir) -> list[int]:
    return [s for s, _ in ckpt.list_checkpoints(run_dir)]


def final(run_dir) -> bytes:
    return (run_dir / names.checkpoint_name(TARGET)).read_bytes()


def two_ranks(run_dir, *args: str) -> None:
    result = subprocess.run(launcher_argv(run_dir, *args), capture_output=True, text=True, timeout=300, env=env(),
                            cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.fixture
def off_disk(tmp_path):
    """A directory on another filesystem than the run's (a replica must be off the run's disk): /dev/shm's tmpfs."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no filesystem apart from the run's for the replica")
    where = Path(tempfile.mkdtemp(prefix="andrea-muon-replica-", dir=shm))
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module")
def straight(prepared, tmp_path_factory):
    """The reference: one process, modern + Muon, never stopped, to TARGET."""
    run = seed_data(prepared, tmp_path_factory.mktemp("muon") / "straight")
    result = train(run, "--steps", str(TARGET), *RECIPE, *QUIET, *MICRO)
    assert result.returncode == 0, result.stderr[-4000:]
    return run


def test_sigkill_resume_and_a_restore_from_the_replica_end_in_the_never_stopped_bytes(straight, prepared, tmp_path,
                                                                                     off_disk):
    run, replica = seed_data(prepared, tmp_path / "run"), off_disk / "replica"
    flags = [*RECIPE, *QUIET, *MICRO, "--set", f'checkpoint.replica="{replica}"']
    t = Trainer(run, "--steps", str(TARGET), *flags)
    try:
        t.wait_ready()
        wait_until(lambda: checkpoints(run) and checkpoints(run)[-1] >= 5, 120, "a committed checkpoint")
        t.proc.kill()
        t.wait_exit(30)
    finally:
        t.kill()
    assert checkpoints(run)[-1] < TARGET
    resumed = train(run, "--steps", "10", *flags)  # SIGKILL, then a resume (which replicates its checkpoints)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert andrea_here("verify", str(run)).returncode == 0  # checksums of Muon's m and v regions
    back = tmp_path / "restored"
    restored = andrea("restore", str(replica), "--run-dir", str(back))
    assert restored.returncode == 0 and "restored step 10" in restored.stdout, restored.stderr[-4000:]
    again = train(back, "--steps", str(TARGET), *flags)
    assert again.returncode == 0, again.stderr[-4000:]
    assert final(back) == final(straight)


def test_two_ranks_follow_one_process_and_resume_bit_exact(straight, prepared, tmp_path):
    whole, stopped = seed_data(prepared, tmp_path / "whole"), tmp_path / "stopped"
    two_ranks(whole, "--steps", str(TARGET), *RECIPE, *QUIET, *MICRO)
    shutil.copytree(whole, stopped)  # the never-stopped run as it stood at step 10: its later checkpoints gone
    for step in (15, 20):
        (stopped / names.checkpoint_name(step)).unlink()
    two_ranks(stopped, "--steps", str(TARGET), *RECIPE, *QUIET, *MICRO)
    assert [e["step"] for e in ledger(stopped) if e.get("event") == "resume"] == [10]
    assert final(stopped) == final(whole)  # 2 -> 2: bit-exact
    got = {e["step"]: e for e in history(ledger(whole)) if "event" not in e}
    ref = {e["step"]: e for e in history(ledger(straight)) if "event" not in e}
    assert sorted(got) == sorted(ref) == list(range(1, TARGET + 1))
    for s in ref:  # the documented tolerance of two ranks against one process (tests/sharding.py)
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=LOSS_RTOL), s
        assert got[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=NORM_AT_START if s == 1 else NORM_RTOL)
    a, b = (np.frombuffer(final(d), dtype="<f4", offset=8).reshape(3, -1) for d in (whole, straight))
    for region, rtol in zip("wmv", (1e-3, 2e-2, 1e-2)):
        i = "wmv".index(region)
        assert np.abs(a[i] - b[i]).max() <= rtol * np.abs(b[i]).max(), region
    assert andrea_here("verify", str(whole)).returncode == 0


def test_the_guard_rolls_a_muon_run_back_and_it_heals(prepared, tmp_path):
    """A non-finite step (ANDREA_TEST_POISON_STEPS=15): no checkpoint for it, a rollback to a committed one whose
    m holds Muon's momentum, and the replay reaches TARGET with every checkpoint valid."""
    run = seed_data(prepared, tmp_path / "run")
    r = train(run, "--steps", str(TARGET), *RECIPE, *QUIET, "--set", "guard.confirm_steps=5",
              extra_env={"ANDREA_TEST_POISON_STEPS": "15"})
    assert r.returncode == 0, r.stderr[-4000:]
    [rollback] = [e for e in ledger(run) if e.get("event") == "rollback"]
    assert rollback["from"] == 15 and rollback["step"] in (5, 10), rollback
    assert [e["step"] for e in history(ledger(run)) if "event" not in e] == list(range(1, TARGET + 1))
    assert checkpoints(run)[-1] == TARGET
    assert andrea_here("verify", str(run)).returncode == 0


# the modern presets' recipe: NorMuon, with the parts they turn on (value embeddings and smear: their own AdamW
# groups, each cut by ZeRO-1's shard boundaries like any other range), on wsd
NORMUON = ["--set", "model.arch=modern", "--set", "train.optimizer=normuon", "--set", "train.schedule=wsd",
           "--set", "train.warmdown_steps=8", "--set", "train.lr_decay_steps=20", "--set", "train.muon_weight_decay=0.1",
           "--set", "train.muon_momentum_warmup=10", "--set", "model.value_embeds=true", "--set", "model.smear=true",
           "--checkpoint-every", "5"]


def resumed_from_10(run, stopped, launch) -> None:
    """`run` as it stood at step 10 (its later checkpoints gone) copied to `stopped`, and run again to TARGET."""
    shutil.copytree(run, stopped)
    for step in (15, 20):
        (stopped / names.checkpoint_name(step)).unlink()
    launch(stopped)
    assert [e["step"] for e in ledger(stopped) if e.get("event") == "resume"] == [10]


def test_normuon_on_wsd_resumes_bit_exact_in_one_process_and_on_two_ranks(prepared, tmp_path):
    """train.optimizer = normuon (its second moment in v, its scheduled momentum and decay) on train.schedule = wsd
    (the warmdown crossing the resume): 1 -> 1 and 2 -> 2 end in the bytes of the run that never stopped, and the
    two ranks follow the one process step by step within the documented tolerance (tests/sharding.py)."""
    def one(run):
        r = train(run, "--steps", str(TARGET), *NORMUON, *QUIET)
        assert r.returncode == 0, r.stderr[-4000:]

    def two(run):
        two_ranks(run, "--steps", str(TARGET), *NORMUON, *QUIET)

    for launch, name in ((one, "one"), (two, "two")):
        run = seed_data(prepared, tmp_path / name)
        launch(run)
        resumed_from_10(run, tmp_path / f"{name}-stopped", launch)
        assert final(tmp_path / f"{name}-stopped") == final(run), name
        v = np.frombuffer(final(run), dtype="<f4", offset=8).reshape(3, -1)[2]
        assert (v != 0).any()  # NorMuon's second moments and AdamW's, in the file
        assert andrea_here("verify", str(run)).returncode == 0
    got = {e["step"]: e for e in history(ledger(tmp_path / "two")) if "event" not in e}
    ref = {e["step"]: e for e in history(ledger(tmp_path / "one")) if "event" not in e}
    assert sorted(got) == sorted(ref) == list(range(1, TARGET + 1))
    for s in ref:
        assert got[s]["lr"] == ref[s]["lr"], s  # one schedule, the warmdown's steps included
        assert got[s]["loss"] == pytest.approx(ref[s]["loss"], rel=LOSS_RTOL), s
        assert got[s]["grad_norm"] == pytest.approx(ref[s]["grad_norm"], rel=NORM_AT_START if s == 1 else NORM_RTOL)


def test_the_guard_rolls_a_normuon_run_back_and_a_stop_after_the_rollback_resumes_into_its_bytes(prepared, tmp_path):
    """normuon on wsd, a non-finite step 15 (ANDREA_TEST_POISON_STEPS): rolled back, it heals to TARGET; the same
    run stopped by SIGTERM after its rollback and resumed (its remedy read back from the guard's record) ends in the
    same step_TARGET.bin and guard record as the run that went through."""
    guarded = [*NORMUON, *QUIET, "--set", "guard.confirm_steps=5"]
    run = seed_data(prepared, tmp_path / "run")
    r = train(run, "--steps", str(TARGET), *guarded, extra_env={"ANDREA_TEST_POISON_STEPS": "15"})
    assert r.returncode == 0, r.stderr[-4000:]
    [rollback] = [e for e in ledger(run) if e.get("event") == "rollback"]
    assert rollback["from"] == 15 and rollback["step"] in (5, 10), rollback
    assert [e["step"] for e in history(ledger(run)) if "event" not in e] == list(range(1, TARGET + 1))
    assert andrea_here("verify", str(run)).returncode == 0
    stopped = seed_data(prepared, tmp_path / "stopped")
    t = Trainer(stopped, "--steps", str(TARGET), *guarded, "--set", "train.log_every=1",
                extra_env={"ANDREA_TEST_POISON_STEPS": "15", "ANDREA_TEST_STEP_DELAY": "0.3"})
    try:
        t.wait_for(lambda line: "guard: rolled back from step" in line, 120)
        first = next(i for i, line in enumerate(t.lines) if "rolled back" in line)
        t.wait_for(lambda line: f"step {rollback['step'] + 2}/" in line and t.lines.index(line) > first, 60)
        t.proc.send_signal(signal.SIGTERM)
        assert t.wait_exit(60) == 0
    finally:
        t.kill()
    assert checkpoints(stopped)[-1] < TARGET and [e for e in ledger(stopped) if e.get("event") == "rollback"]
    again = train(stopped, "--steps", str(TARGET), *guarded)
    assert again.returncode == 0, again.stderr[-4000:]
    assert final(stopped) == final(run)
    guard = names.checkpoint_name(TARGET).replace(".bin", ".guard.json")
    assert (stopped / guard).read_bytes() == (run / guard).read_bytes()
