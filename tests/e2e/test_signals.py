"""docs/operating.md with real processes and real signals: SIGUSR1 writes and continues, SIGTERM writes and exits."""

import os
import random
import re
import signal
import time

import pytest

from andrea.rundir import checkpoint as ckpt, names
from tests.runs import Trainer, andrea_here, header, ledger, seed_data, steps_in_ledger, train, wait_until

FAR = ["--checkpoint-every", "100000"]  # no cadence checkpoints: every file on disk was asked for
LIVE = ["--set", "train.log_every=1"]  # a progress line per step: the tests follow the trainer's output
TARGET = 60  # where both resume tests end: 30+ steps past their interruption, which a signal outruns


def wait_step(t: Trainer, run_dir, at_least: int, timeout: float = 60) -> int:
    """Wait for the trainer's progress line of a step >= at_least; return that step."""
    def reached(line):
        m = re.search(r"step (\d+)/", line)
        return m and int(m.group(1)) >= at_least
    return int(re.search(r"step (\d+)/", t.wait_for(reached, timeout)).group(1))


def checkpoints(run_dir) -> list[int]:
    return [s for s, _ in ckpt.list_checkpoints(run_dir)]


def test_sigusr1_checkpoints_and_continues_a_second_trainer_is_refused_and_sigterm_exits_clean(prepared, tmp_path):
    """One trainer met as an operator meets it: SIGUSR1 checkpoints the step in flight and training goes on, a
    second trainer on its run is refused naming it, `ctl` reports it and signals it (checkpoint: SIGUSR1, stop:
    SIGTERM), and SIGTERM checkpoints the last step and exits 0."""
    run = seed_data(prepared, tmp_path / "run")
    t = Trainer(run, "--steps", "100000", *FAR, *LIVE)
    try:
        t.wait_ready()
        sent_at = wait_step(t, run, 5)
        t.proc.send_signal(signal.SIGUSR1)
        wait_until(lambda: checkpoints(run), 30, "the SIGUSR1 checkpoint")
        (first,) = checkpoints(run)
        assert first > sent_at
        second = train(run, "--steps", "5")
        message = second.stderr.strip().splitlines()[-1]
        assert second.returncode == 1 and message.startswith("andrea: error: "), second.stderr[-2000:]
        assert f"another trainer (pid {t.proc.pid})" in message
        wait_step(t, run, first + 5)  # still training, undisturbed by the second trainer
        assert t.proc.poll() is None
        status = andrea_here("ctl", str(run), "status", "--json")
        assert status.returncode == 0 and f'"pid": {t.proc.pid}' in status.stdout and '"running": true' in status.stdout
        assert andrea_here("ctl", str(run), "checkpoint", "--timeout", "30").returncode == 0
        assert checkpoints(run)[-1] > first
        assert andrea_here("ctl", str(run), "stop", "--timeout", "30").returncode == 0
        assert t.wait_exit(10) == 0
    finally:
        t.kill()
    newest = ckpt.list_checkpoints(run)[-1][1]
    assert header(newest)[0] == steps_in_ledger(run)[-1]
    assert andrea_here("verify", str(run)).returncode == 0
    assert "SIGTERM received" in t.output()
    status = andrea_here("ctl", str(run), "status", "--json")
    assert '"running": false' in status.stdout and f'"newest_checkpoint": "{newest.name}"' in status.stdout
    assert [e["event"] for e in ledger(run) if "event" in e][:1] == ["start"]


@pytest.fixture(scope="module")
def straight(prepared, tmp_path_factory):
    """One uninterrupted run to TARGET, its only checkpoint at the end: the bytes every interrupted run resumed to
    TARGET must reproduce (the interrupted runs' own checkpoint cadences write files, never change the training)."""
    run = seed_data(prepared, tmp_path_factory.mktemp("straight") / "run")
    result = train(run, "--steps", str(TARGET), *FAR)
    assert result.returncode == 0, result.stderr
    return run / names.checkpoint_name(TARGET)


def test_sigterm_at_a_random_step_resumes_bit_identically(prepared, tmp_path, straight):
    run = seed_data(prepared, tmp_path / "run")
    t = Trainer(run, "--steps", str(TARGET), *FAR, *LIVE)
    try:
        t.wait_ready()
        wait_step(t, run, random.Random(7).randint(3, TARGET // 2))
        t.proc.send_signal(signal.SIGTERM)
        assert t.wait_exit(30) == 0
    finally:
        t.kill()
    stopped_at = checkpoints(run)[-1]
    assert stopped_at < TARGET
    assert train(run, "--steps", str(TARGET), *FAR).returncode == 0
    assert (run / straight.name).read_bytes() == straight.read_bytes()


def test_sigkill_resumes_from_last_committed_checkpoint_bit_identically(prepared, tmp_path, straight):
    run = seed_data(prepared, tmp_path / "run")
    t = Trainer(run, "--steps", str(TARGET), "--checkpoint-every", "10")
    try:
        t.wait_ready()
        wait_until(lambda: checkpoints(run) and checkpoints(run)[-1] >= 20, 60, "a committed checkpoint")
        t.proc.send_signal(signal.SIGKILL)
        t.wait_exit(30)
    finally:
        t.kill()
    assert checkpoints(run)[-1] < TARGET
    assert andrea_here("verify", str(run)).returncode == 0
    assert train(run, "--steps", str(TARGET), "--checkpoint-every", "10").returncode == 0
    assert (run / straight.name).read_bytes() == straight.read_bytes()


def test_sigkill_during_a_commit_leaves_only_valid_checkpoints(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    t = Trainer(run, "--steps", "1000", "--checkpoint-every", "10", extra_env={"ANDREA_TEST_COMMIT_DELAY": "2"})
    try:
        t.wait_ready()
        wait_until(lambda: checkpoints(run) and list(run.glob("step_*.bin.tmp")), 60,
                   "a committed checkpoint and the next commit in progress")
        t.proc.send_signal(signal.SIGKILL)
        t.wait_exit(30)
    finally:
        t.kill()
    (tmp,) = run.glob("*.bin.tmp")  # the interrupted commit's complete temp file is still there ...
    result = andrea_here("verify", str(run))
    assert result.returncode == 0, result.stderr
    verified = [line for line in result.stdout.splitlines() if line.startswith("ok ") and ".bin step=" in line]
    assert tmp.name not in result.stdout and len(verified) == len(checkpoints(run))  # ... not taken
    resumed = train(run, "--steps", "12", "--checkpoint-every", "10")
    assert resumed.returncode == 0, resumed.stderr
    assert not list(run.glob("*.tmp"))
    assert andrea_here("verify", str(run)).returncode == 0


def test_a_storm_of_sigusr1_coalesces(prepared, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    t = Trainer(run, "--steps", "100000", *FAR, *LIVE, extra_env={"ANDREA_TEST_COMMIT_DELAY": "0.3"})
    try:
        t.wait_ready()
        wait_step(t, run, 3)
        for _ in range(50):  # spaced: the kernel itself merges signals sent back to back
            os.kill(t.proc.pid, signal.SIGUSR1)
            time.sleep(0.02)
        wait_until(lambda: checkpoints(run), 30, "a checkpoint after the storm")
        wait_step(t, run, checkpoints(run)[0] + 10)
        assert t.proc.poll() is None
        t.proc.send_signal(signal.SIGTERM)
        assert t.wait_exit(30) == 0
    finally:
        t.kill()
    # 50 signals in a second, commits of 0.3 s: a handful of checkpoints (+ the final one)
    assert 1 <= len(checkpoints(run)) <= 6
    assert andrea_here("verify", str(run)).returncode == 0
    assert "coalesced" in t.output()
