"""The watchdog and the notices end to end: real `python -m andrea train` processes on the tiny preset.

A hung training step and a hung checkpoint write (the test hook ANDREA_TEST_HANG, control/observe/watchdog.py) end the
process with exit code 75 within the watchdog's limit, every thread's stack in its log, and a restart resumes to
the same bytes as a run that never hung. Notices (control/observe/notify.py) reach a loopback HTTP server; a hook command
that fails does not fail the run.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import sys
import time

import pytest

from andrea.config.keepers import STALL_EXIT_CODE
from tests.notices import Inbox
from tests.runs import Launched, Trainer, free_port, launcher_argv, ledger, seed_data, train

STEPS = ["--steps", "30", "--checkpoint-every", "10"]
FLOOR = 4.0
# A small limit: the floor, or twice the longest wait without progress seen (the tiny preset's steps are short).
FAST_DOG = ["--set", f"watchdog.floor_s={FLOOR}", "--set", "watchdog.factor=2"]
CALM = ["--set", "watchdog.floor_s=300"]  # the restart: run.toml kept the test's small limit


@pytest.fixture(scope="module")
def reference(prepared, tmp_path_factory):
    """30 steps that never hung, without a watchdog: the bytes a restarted run (watchdog on) must reach."""
    run = seed_data(prepared, tmp_path_factory.mktemp("reference") / "run")
    r = train(run, *STEPS, "--set", "watchdog.enabled=false")
    assert r.returncode == 0, r.stderr[-4000:]
    return run


@pytest.fixture
def inbox():
    box = Inbox()
    yield box
    box.close()


def until_exit_after_the_hang(t: Trainer) -> tuple[int, float]:
    """(exit status, seconds from the test hook's hang to the process's exit)."""
    try:
        t.wait_for(lambda line: "ANDREA_TEST_HANG" in line and "hangs now" in line, timeout=240)
        hung_at = time.monotonic()
        rc = t.wait_exit(120)
        return rc, time.monotonic() - hung_at
    finally:
        t.kill()


def hang_and_wait(run, where: str, inbox: Inbox) -> tuple[Trainer, float]:
    """A trainer whose `where` thread hangs at step 20; (the trainer after its exit, seconds from hang to exit)."""
    t = Trainer(run, *STEPS, *FAST_DOG, "--set", f'notify.url="{inbox.url}"',
                extra_env={"ANDREA_TEST_HANG": f"{where}@20"})
    rc, took = until_exit_after_the_hang(t)
    assert rc == STALL_EXIT_CODE, t.output()[-4000:]
    return t, took


def assert_resumes_to_the_same_bytes(run, reference) -> None:
    r = train(run, *STEPS, *CALM)
    assert r.returncode == 0, r.stderr[-4000:]
    assert (run / "step_000030.bin").read_bytes() == (reference / "step_000030.bin").read_bytes()


def test_a_hung_training_step_exits_75_with_its_stacks_and_resumes_to_the_same_bytes(prepared, reference, inbox,
                                                                                       tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    t, took = hang_and_wait(run, "train", inbox)
    out = t.output()
    assert "watchdog: the training thread made no progress" in out, out[-4000:]
    assert took < FLOOR + 10, f"exited {took:.1f}s after the hang, limit ~{FLOOR}s"  # the limit, and the slack of a
    # loaded 2-core machine: never the 30 minutes of a collective timeout or forever
    # every thread's stack, the hung one in the test hook's wait
    assert "most recent call first" in out and 'Thread 0x' in out and "in test_hang" in out, out[-4000:]
    (stall,) = [e for e in ledger(run) if e.get("event") == "stall"]
    assert stall["component"] == "train" and stall["step"] >= 19 and stall["limit"] >= FLOOR
    notice = inbox.wait_for("stall")
    assert notice["component"] == "train" and notice["run_dir"] == str(run.resolve())
    assert_resumes_to_the_same_bytes(run, reference)


def test_a_hung_checkpoint_write_exits_75_and_resumes_to_the_same_bytes(prepared, reference, inbox, tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    t, took = hang_and_wait(run, "io", inbox)
    out = t.output()
    assert "watchdog: the I/O thread made no progress" in out, out[-4000:]
    assert took < FLOOR + 10 and "in test_hang" in out, out[-4000:]
    assert not (run / "step_000020.bin").exists()
    assert [e for e in ledger(run) if e.get("event") == "stall"] == []  # its thread was the one hung
    assert inbox.wait_for("stall")["component"] == "io"
    assert_resumes_to_the_same_bytes(run, reference)


def test_notices_of_a_rollback_and_a_stop_reach_the_url_and_a_failing_command_is_only_a_warning(prepared, inbox,
                                                                                                tmp_path):
    run = seed_data(prepared, tmp_path / "run")
    failing = shlex.join([sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(3)"])
    t = Trainer(run, "--steps", "100000", "--checkpoint-every", "10", "--set", f'notify.url="{inbox.url}"',
                "--set", f"notify.command={json.dumps(failing)}",
                extra_env={"ANDREA_TEST_POISON_STEPS": "5", "ANDREA_TEST_STEP_DELAY": "0.05"})
    try:
        rollback = inbox.wait_for("rollback", timeout=180)
        t.proc.send_signal(signal.SIGTERM)
        assert t.wait_exit(60) == 0, t.output()[-4000:]
    finally:
        t.kill()
    stopped = inbox.wait_for("stopped")
    incident = inbox.wait_for("incident")
    assert incident["step"] == 5 and "not finite" in incident["reason"]
    assert (rollback["from"], rollback["step"]) == (5, 0)
    assert stopped["signal"] == "SIGTERM" and stopped["step"] >= rollback["step"]
    kinds = inbox.kinds()
    assert kinds.index("incident") < kinds.index("rollback") < kinds.index("stopped") == len(kinds) - 1
    assert "notify.command: the stopped notice exited 3" in t.output()


def test_one_hung_rank_brings_the_whole_torchrun_job_down_within_the_limit_and_on_the_record(prepared, tmp_path):
    """Rank 1's training thread hangs after step 4; rank 0 waits for it in a collective. Neither may wait forever:
    the launcher (which ends only when both workers have ended) exits non-zero within the limit. Each step is
    held 1.5 s, as a step of a larger model takes: rank 0 starts waiting a step after rank 1 hung, so rank 1's
    watchdog fires first, and rank 0, which holds the ledger, learns of it from rank 1's stall note
    (control/parallel/stall_notes.py): the ledger's `stall` marker names rank 1 (issue 46: it used to be missing)."""
    run = seed_data(prepared, tmp_path / "run")
    t = Launched(launcher_argv(run, *STEPS, *FAST_DOG),
                 extra_env={"ANDREA_TEST_HANG": "train@4@1", "ANDREA_TEST_STEP_DELAY": "1.5"})
    rc, took = until_exit_after_the_hang(t)
    out = t.output()
    assert rc != 0 and took < FLOOR + 15, f"rc {rc} after {took:.1f}s:\n" + out[-4000:]
    assert re.search(r"andrea\.watchdog\[1\]: watchdog: the training thread made no progress", out), out[-4000:]
    assert re.search(r"andrea\.watchdog\[0\]: watchdog: rank 1 \(.*\) found the training thread hung", out), \
        out[-4000:]
    assert "in test_hang" in out, out[-4000:]  # the hung rank's own stacks
    (stall,) = [e for e in ledger(run) if e.get("event") == "stall"]
    assert stall["rank"] == 1 and stall["component"] == "train" and stall["limit"] >= FLOOR, stall
    # torchrun's failure report: rank 0 ended on the note by itself (75), not by its peer's SIGKILL (-9)
    exits = dict(re.findall(r"rank\s*:\s*(\d) \(local_rank: \d\)\s*\n\s*exitcode\s*:\s*(-?\d+)", out))
    assert exits == {"0": str(STALL_EXIT_CODE), "1": str(STALL_EXIT_CODE)}, out[-3000:]


def on_host(name: str, argv: list[str]) -> list[str]:
    """argv in a UTS namespace of its own whose hostname is `name`: a node of its own to the job's ranks."""
    return ["unshare", "-u", "bash", "-c", f"hostname {shlex.quote(name)} && exec {shlex.join(argv)}"]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare(1)")
def test_a_hung_rank_on_another_host_ends_the_job_on_every_host_and_on_the_record(prepared, tmp_path):
    """Two torchrun launchers as two hosts (node0 holds rank 0, node1 rank 1). Rank 1 hangs after step 4; its
    watchdog has no rank on its host to end, so only its stall note reaches rank 0 (control/parallel/stall_notes.py):
    rank 0 writes the marker naming rank 1 and exits 75 by itself, without waiting for its collective to fail or
    for its own watchdog, and both launchers end within the limit."""
    run = seed_data(prepared, tmp_path / "run")
    port = free_port()
    hang = {"ANDREA_TEST_HANG": "train@4@1", "ANDREA_TEST_STEP_DELAY": "1.5"}
    nodes = [Launched(on_host(f"node{k}", launcher_argv(run, *STEPS, *FAST_DOG, launch=(
        "--nnodes=2", f"--node_rank={k}", "--nproc_per_node=1", "--master_addr=127.0.0.1",
        f"--master_port={port}"))), extra_env=hang) for k in (0, 1)]
    try:
        nodes[1].wait_for(lambda line: "ANDREA_TEST_HANG" in line and "hangs now" in line, timeout=240)
        hung_at = time.monotonic()
        codes = [node.wait_exit(120) for node in nodes]
        took = time.monotonic() - hung_at
    finally:
        for node in nodes:
            node.kill()
    out0, out1 = (node.output() for node in nodes)
    assert all(rc != 0 for rc in codes) and took < FLOOR + 15, f"{codes} after {took:.1f}s:\n" + out0[-3000:]
    assert "andrea.watchdog[1]: watchdog: the training thread made no progress" in out1, out1[-3000:]
    assert "other ranks on this host" not in out1  # node1 holds no other rank: the note alone ends rank 0
    assert re.search(r"andrea\.watchdog\[0\]: watchdog: rank 1 \(node1, pid \d+\) found the training thread hung",
                     out0), out0[-4000:]
    (stall,) = [e for e in ledger(run) if e.get("event") == "stall"]
    assert stall["rank"] == 1 and stall["component"] == "train", stall
    exits = dict(re.findall(r"rank\s*:\s*(\d) \(local_rank: \d\)\s*\n\s*exitcode\s*:\s*(-?\d+)", out0))
    assert exits == {"0": str(STALL_EXIT_CODE)}, out0[-3000:]  # ended on the note, not by a failed collective


def test_a_frozen_rank_ends_the_whole_job_well_before_torchruns_30_s(prepared, tmp_path):
    """Issue 46: rank 1 frozen (SIGSTOP: its own watchdog is frozen with it, and it answers no SIGTERM). Rank 0's
    watchdog exits 75, and torchrun used to wait its 30 s before SIGKILLing the stopped worker. The watchdog now
    ends the ranks on its host it learned at start: the job ends within 10 s of the detection (how long the
    detection takes is the watchdog's limit, which a loaded machine raises; the other tests bound it)."""
    run = seed_data(prepared, tmp_path / "run")
    t = Launched(launcher_argv(run, "--steps", "100000", "--checkpoint-every", "1000", *FAST_DOG),
                 extra_env={"ANDREA_TEST_STEP_DELAY": "0.02"})
    frozen = None
    try:
        ready = t.wait_for(lambda line: "ready pid=" in line and "rank=1/2" in line, timeout=240)
        frozen = int(ready.split("ready pid=", 1)[1].split()[0])
        t.wait_for(lambda line: "step 30/" in line, timeout=120)  # training, both ranks in lockstep
        os.kill(frozen, signal.SIGSTOP)
        t.wait_for(lambda line: "andrea.watchdog[0]: watchdog:" in line and "made no progress" in line, timeout=120)
        rc = t.wait_exit(10)  # the bound, well under torchrun's 30 s: raises subprocess.TimeoutExpired past it
    finally:
        if frozen is not None:
            for sig in (signal.SIGCONT, signal.SIGKILL):  # never leave a stopped process behind
                try:
                    os.kill(frozen, sig)
                except ProcessLookupError:
                    break
        t.kill()
    out = t.output()
    assert rc != 0, out[-4000:]
    assert "andrea.watchdog[0]: watchdog:" in out and f"ending the job's other ranks on this host (pids {frozen})" \
        in out, out[-4000:]
    (stall,) = [e for e in ledger(run) if e.get("event") == "stall"]  # rank 0's own detection, on the record
    assert stall["rank"] == 0, stall

