"""The divergence guard end to end: real `python -m andrea train` processes on the tiny preset.

Two ways to make a run diverge, for two kinds of assertion:
- `ANDREA_TEST_POISON_STEPS=<n>[,<n>...]` (control/run/step_hooks.py, the step's one test seam): the step record of step n reads
  loss = NaN the first time the process reaches n, a non-finite incident at exactly that step on every machine.
  The tests that need the guard in one exact situation (the known-good checkpoint a later one than the start,
  the attempts used up) construct it with this hook, so they exercise the same case on every CPU.
- issue #11's real divergence: lr = 1.0 without gradient clipping leaves the basin within a few steps (without
  the guard: validation loss 85 at step 50, 79 at step 400, against 4.00 for the healthy run). Its course is
  chaotic: the steps of its incidents and rollbacks change with the CPU's vector kernels (ATEN_CPU_CAPABILITY)
  and thread counts, so these tests assert only what holds on any of its trajectories, and the byte-identity
  checks compare two runs on the same machine.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys

import pytest

from andrea.rundir.ledger import history
from tests.runs import ROOT, Trainer, andrea_here, env, ledger, seed_data, train

DIVERGE = ["--checkpoint-every", "20", "--set", "train.lr=1.0", "--set", "train.grad_clip=0"]
SPAN = 400  # steps of the healthy reference and of the real divergence, compared at their last eval (every 50)
KEEP_ONE = ["--set", "checkpoint.keep_last=1", "--set", "checkpoint.keep_every=0"]  # only the guard keeps a G
# The guard's bands opened wide: no finite record is ever anomalous, so confirmations follow from step counts
# alone (an anomaly of a healthy run's own course would delay one); a non-finite record is still an incident.
QUIET = [a for k in ("loss_sigmas", "loss_margin", "grad_sigmas", "grad_margin") for a in ("--set", f"guard.{k}=1e9")]


def events(run_dir, name: str) -> list[dict]:
    return [e for e in ledger(run_dir) if e.get("event") == name]


def final_val(run_dir, step: int) -> float:
    return [e for e in events(run_dir, "eval") if e["step"] == step][-1]["val_loss"]


def poison(*steps: int) -> dict[str, str]:
    return {"ANDREA_TEST_POISON_STEPS": ",".join(map(str, steps))}


def assert_continuous(run_dir, last: int) -> None:
    """The ledger's history (rollbacks supersede the abandoned timeline) holds steps 1..last, each once."""
    assert [e["step"] for e in history(ledger(run_dir)) if "event" not in e] == list(range(1, last + 1))


@pytest.fixture(scope="module")
def healthy(prepared, tmp_path_factory):
    """400 steps at the preset's learning rate, cadence 20: the reference the guarded runs are held to. The guard's
    decisions over ten seeds' first 500 steps are checked on their recording (tests/unit/control/guard/
    test_healthy_series.py) and the whole 2000-step schedule by the slow test below; this run proves that the
    trainer process, which wires them to its checkpoints, raises nothing on a healthy course."""
    run_dir = seed_data(prepared, tmp_path_factory.mktemp("healthy") / "run")
    r = train(run_dir, "--steps", str(SPAN), "--checkpoint-every", "20")
    assert r.returncode == 0, r.stderr
    return run_dir


def test_a_healthy_run_never_triggers(healthy):
    assert events(healthy, "incident") == [] and events(healthy, "rollback") == []
    assert_continuous(healthy, SPAN)


def test_a_divergence_after_a_newer_checkpoint_rolls_back_to_the_retained_known_good_one(prepared, tmp_path):
    """The case retention must not break (issue #28, item 4), constructed: cadence 10 and confirm_steps 15, so
    at step 40 the known-good checkpoint G is 20 (confirmed at step 35) and 30 is tentative; keep_last = 1
    without the guard's protection would have deleted 20 when 30 landed. Step 40's record is NaN: the commit
    gate must refuse step 40 (item 5), the rollback must read step 20, and the run heals."""
    run = seed_data(prepared, tmp_path / "run")
    r = train(run, "--steps", "70", "--checkpoint-every", "10", "--set", "guard.confirm_steps=15", *KEEP_ONE,
              *QUIET, extra_env=poison(40))
    assert r.returncode == 0, r.stderr[-4000:]
    (incident,) = events(run, "incident")
    (rb,) = events(run, "rollback")
    assert incident["step"] == 40 and "not finite" in incident["reason"]
    assert (rb["from"], rb["step"], rb["checkpoint"]) == (40, 20, "step_000020.bin"), rb
    assert (rb["attempt"], rb["remedy"], rb["data_offset"]) == (1, "skip_data", 20)
    log = r.stderr.splitlines()
    rolled = [i for i, line in enumerate(log) if "guard: rolled back from step 40 to step_000020.bin" in line]
    assert rolled, r.stderr[-4000:]
    before = log[:rolled[0]]
    assert not any("step_000040.bin committed" in line for line in before), "committed while the incident was pending"
    assert any("not checkpointing step 40: it is diverging" in line for line in before), r.stderr[-4000:]
    assert_continuous(run, 70)  # healed: step 40 reached again (the hook poisons once), no second incident
    assert andrea_here("verify", str(run)).returncode == 0
    assert '"rollbacks": 1' in andrea_here("status", str(run), "--json").stdout


def test_the_real_lr_1_divergence_heals_itself(healthy, prepared, tmp_path):
    """lr = 1.0 on any trajectory: at least one incident, each rollback backwards to a checkpoint the run could
    read (the initial state or a retained file, keep_last = 1), and the run ends healed: within twice the healthy
    run's held-out loss, where the unguarded run ends at about twenty times it (79 at step 400; 85 at step 50).
    The guarded course is deterministic on one machine but follows the CPU kernels (.ci/run's avx2 and default):
    at step 400, 5.53 / 5.41 / 5.48 on native / avx2 / default against 3.70 healthy; a 200-step run under
    default read 6.32, past the 1.5x bar this test once had."""
    sick = seed_data(prepared, tmp_path / "sick")
    r = train(sick, "--steps", str(SPAN), *DIVERGE, *KEEP_ONE)
    assert r.returncode == 0, r.stderr[-4000:]
    rollbacks = events(sick, "rollback")
    assert rollbacks and len(events(sick, "incident")) == len(rollbacks)
    for e in rollbacks:
        assert e["from"] > e["step"] and e["checkpoint"] in ("initial state", f"step_{e['step']:06d}.bin"), e
    assert_continuous(sick, SPAN)
    assert final_val(sick, SPAN) <= 2.0 * final_val(healthy, SPAN)
    assert andrea_here("verify", str(sick)).returncode == 0
    assert '"rollbacks": %d' % len(rollbacks) in andrea_here("status", str(sick), "--json").stdout


def test_bounded_attempts_stop_with_one_line(prepared, tmp_path):
    """Two incidents with guard.max_attempts = 1 (steps 5 and, after the rollback to the start, 8): the second
    gives up with one error line naming the checkpoint to resume from."""
    run_dir = seed_data(prepared, tmp_path / "run")
    r = train(run_dir, "--steps", "100", "--checkpoint-every", "20", "--set", "guard.max_attempts=1",
              extra_env=poison(5, 8))
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("andrea: error:")]
    assert len(errors) == 1, r.stderr
    stop = events(run_dir, "guard_stop")[-1]
    assert stop["step"] == 8 and errors[0].startswith("andrea: error: step 8: ")
    assert "1 rollback " in errors[0] and "resume from step_000000.bin" in errors[0]
    assert sorted(p.name for p in run_dir.glob("step_*.bin")) == ["step_000000.bin"]
    assert andrea_here("verify", str(run_dir)).returncode == 0


def test_stop_and_resume_in_the_middle_of_an_incident_is_byte_identical(prepared, tmp_path):
    whole = seed_data(prepared, tmp_path / "whole")
    r = train(whole, "--steps", "60", *DIVERGE)
    assert r.returncode == 0, r.stderr[-4000:]
    expected = (whole / "step_000060.bin").read_bytes()
    # The first step at which the divergence is one anomaly short of an incident, as this machine's course of
    # the run has it (the same process on the same machine takes the same course).
    short = re.search(r"guard: step (\d+) anomalous: .* \(2 of the last", r.stderr)
    assert short and "incident at step" not in r.stderr[:short.start()], r.stderr[-4000:]
    shut = int(short.group(1))

    # --steps <shut>: the gate is shut at the step target (issue 46): never a stop short of it with exit 0, but an
    # incident, rolled back and trained again up to the target, or the bounded stop's one line
    early = seed_data(prepared, tmp_path / "early")
    r = train(early, "--steps", str(shut), *DIVERGE)
    assert f"not checkpointing step {shut}" in r.stderr, r.stderr[-4000:]
    held = [e for e in events(early, "incident") if e["step"] == shut and "held back" in e["reason"]]
    assert held and events(early, "rollback"), r.stderr[-4000:]
    if r.returncode == 0:
        assert (early / f"step_{shut:06d}.bin").exists()
    else:
        errors = [line for line in r.stderr.splitlines() if line.startswith("andrea: error:")]
        assert r.returncode == 1 and len(errors) == 1 and "resume from step_" in errors[0], r.stderr[-4000:]

    # SIGTERM while the second incident builds up, after the first rollback made its decisions durable
    late = seed_data(prepared, tmp_path / "late")
    t = Trainer(late, "--steps", "60", *DIVERGE, extra_env={"ANDREA_TEST_STEP_DELAY": "0.3"})
    try:
        t.wait_for(lambda line: "guard: rolled back from step" in line, timeout=120)
        first = next(i for i, line in enumerate(t.lines) if "rolled back" in line)
        t.wait_for(lambda line: "guard: step" in line and "(2 of the last" in line and t.lines.index(line) > first)
        signalled = len(t.lines)
        t.proc.send_signal(signal.SIGTERM)
        assert t.wait_exit(60) == 0
    finally:
        t.kill()
    out = t.output()
    assert "SIGTERM during an incident" in out and "writing nothing" in out, out
    # on disk: the start (written by the rollback) and what was committed since, nothing after the signal
    since = {m.group(1) for line in t.lines[first:signalled] for m in [re.search(r"(step_\d+\.bin) committed", line)]
             if m}
    assert sorted(p.name for p in late.glob("step_*.bin")) == sorted({"step_000000.bin"} | since)
    r = train(late, "--steps", "60", *DIVERGE)
    assert r.returncode == 0, r.stderr
    assert (late / "step_000060.bin").read_bytes() == expected
    assert (late / "step_000060.guard.json").read_bytes() == (whole / "step_000060.guard.json").read_bytes()


def test_the_issues_healthy_seeds_raise_no_alarm_in_their_warm_up(prepared, tmp_path):
    """Issue 46 (seed 7: the gate shut at step 28, no final checkpoint at 30) and issue 47 case 5 (seed 9: an
    incident at step 29 of a healthy run): bench/guard_series.py trains their first 80 steps in process with
    control/run/trainer.py, as a run trains them, and feeds them to the guard's decisions: no incident, the commit gate
    never shut. The ten seeds' 500 steps are checked on their recording: tests/unit/control/guard/test_healthy_series.py."""
    out = tmp_path / "series.json"
    r = subprocess.run([sys.executable, "bench/guard_series.py", "--preset", "andrea-tiny", "--seeds", "7,9",
                        "--steps", "80", "--data", str(prepared), "--json", str(out)], cwd=ROOT, env=env(),
                        capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "incidents across seeds: 0" in r.stdout, r.stdout + r.stderr[-2000:]
    for seed in ("7", "9"):
        assert f"| andrea-tiny | {seed} | 80 | 0 | - | - | - |" in r.stdout, r.stdout
    recorded = json.loads(out.read_text())["seeds"]
    assert sorted(recorded) == ["7", "9"] and [s for s, _, _ in recorded["9"]] == list(range(1, 81))


@pytest.mark.slow
def test_defaults_never_trigger_on_the_tiny_whole_schedule():
    """bench/guard.py: the tiny preset's whole schedule (2000 steps) with the default [guard]: zero incidents."""
    r = subprocess.run([sys.executable, "bench/guard.py", "--preset", "andrea-tiny"], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| andrea-tiny | 2000 |" in r.stdout and "| 0 | 0 |" in r.stdout, r.stdout


def settled(run_dir) -> list[tuple]:
    """The ledger's effective step entries as the run trained them (not when: `time` and `mfu` left out)."""
    return [(e["step"], e["loss"], e["lr"], e["grad_norm"], e["tokens"], e["phase"])
            for e in history(ledger(run_dir)) if "event" not in e]


def test_losing_the_known_good_checkpoint_keeps_the_rollbacks_data_offset_and_lr_scale(prepared, tmp_path):
    """Issue 55, hole 2: the data offset and lr scale a rollback set belong to the trajectory. Cadence 10,
    confirm_steps 20, keep_last 2, step 35 poisoned: the rollback to step 10 sets data offset 25. At the stop at
    60 the disk holds 40 (known-good), 50 and 60; step 50's guard companion names 30 as known-good, long released.
    One bit of step_000060.bin flipped: the start resumes from 50, whose known-good pointer is gone; the run must
    still read the data and use the rate it did (the same step_000080.bin and settled ledger as without the flip),
    and `status` report the offset in force. A branch of the retained step 50 reproduces its parent likewise, and
    so does a start whose newest guard companion was lost (the ledger's rollback marker records them too)."""
    keep = ["--checkpoint-every", "10", "--set", "checkpoint.keep_last=2", "--set", "guard.confirm_steps=20"]
    ref = seed_data(prepared, tmp_path / "ref")
    r = train(ref, "--steps", "60", *keep, extra_env=poison(35))
    assert r.returncode == 0, r.stderr[-4000:]
    (rb,) = events(ref, "rollback")
    assert (rb["step"], rb["data_offset"]) == (10, 25), rb
    assert sorted(p.name for p in ref.glob("step_*.bin")) == ["step_000040.bin", "step_000050.bin",
                                                             "step_000060.bin"]
    assert json.loads((ref / "step_000050.guard.json").read_text())["good"]["step"] == 30  # released
    flipped = tmp_path / "flipped"
    shutil.copytree(ref, flipped)
    with open(flipped / "step_000060.bin", "r+b") as f:  # one bit of a weight: a value check cannot see it
        f.seek(5001)
        byte = f.read(1)[0]
        f.seek(5001)
        f.write(bytes([byte ^ 0x10]))
    branch = tmp_path / "branch"
    assert andrea_here("branch", str(ref), "--step", "50", "--to", str(branch)).returncode == 0
    lost = tmp_path / "lost"  # the newest checkpoint's guard companion lost: the ledger's rollback marker holds them
    shutil.copytree(ref, lost)
    (lost / "step_000060.guard.json").unlink()
    for run in (ref, flipped, branch, lost):
        r = train(run, "--steps", "80", *keep)
        assert r.returncode == 0, r.stderr[-4000:]
    expected = (ref / "step_000080.bin").read_bytes()
    for run in (flipped, branch, lost):
        assert (run / "step_000080.bin").read_bytes() == expected, run.name
        assert settled(run) == settled(ref), run.name
    status = json.loads(andrea_here("status", str(flipped), "--json").stdout)
    assert (status["guard"]["data_offset"], status["guard"]["lr_scale"]) == (25, 1.0)
