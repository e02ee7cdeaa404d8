"""The divergence guard end to end: real `python -m andrea train` processes on the tiny preset.

The diverging setup is issue #11's: lr = 1.0 without gradient clipping leaves the basin within ~5 steps
(without the guard: validation loss 85 at step 50, 79 at step 400, against 4.00 for the healthy run).
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from tests.runs import ROOT, Trainer, andrea, env, ledger, seed_data, train

DIVERGE = ["--checkpoint-every", "20", "--set", "train.lr=1.0", "--set", "train.grad_clip=0"]


def events(run_dir, name: str) -> list[dict]:
    return [e for e in ledger(run_dir) if e.get("event") == name]


def final_val(run_dir, step: int) -> float:
    return [e for e in events(run_dir, "eval") if e["step"] == step][-1]["val_loss"]


def test_diverging_run_heals_itself_and_healthy_run_never_triggers(prepared, tmp_path):
    healthy = seed_data(prepared, tmp_path / "healthy")
    r = train(healthy, "--steps", "400", "--checkpoint-every", "20")
    assert r.returncode == 0, r.stderr
    assert events(healthy, "incident") == [] and events(healthy, "rollback") == []
    # keep_last = 1 and no major checkpoints: only the guard's protection keeps the known-good one alive
    sick = seed_data(prepared, tmp_path / "sick")
    r = train(sick, "--steps", "400", *DIVERGE, "--set", "checkpoint.keep_last=1", "--set", "checkpoint.keep_every=0")
    assert r.returncode == 0, r.stderr
    rollbacks = events(sick, "rollback")
    assert rollbacks and all(e["from"] > e["step"] for e in rollbacks)
    assert any(e["step"] > 0 for e in rollbacks), "a rollback to a checkpoint retention would have deleted"
    assert final_val(sick, 400) <= 1.5 * final_val(healthy, 400)
    assert andrea("verify", str(sick)).returncode == 0
    status = andrea("status", str(sick))
    assert '"rollbacks": %d' % len(rollbacks) in status.stdout


def test_bounded_attempts_stop_with_one_line(prepared, tmp_path):
    run_dir = seed_data(prepared, tmp_path / "run")
    r = train(run_dir, "--steps", "100", *DIVERGE, "--set", "guard.max_attempts=1")
    assert r.returncode == 1
    errors = [line for line in r.stderr.splitlines() if line.startswith("andrea: error:")]
    assert len(errors) == 1, r.stderr
    stop = events(run_dir, "guard_stop")[-1]
    assert errors[0].startswith(f"andrea: error: step {stop['step']}: ")
    assert "1 rollback " in errors[0] and "resume from step_000000.bin" in errors[0]
    assert sorted(p.name for p in run_dir.glob("step_*.bin")) == ["step_000000.bin"]
    assert andrea("verify", str(run_dir)).returncode == 0


def test_stop_and_resume_in_the_middle_of_an_incident_is_byte_identical(prepared, tmp_path):
    whole = seed_data(prepared, tmp_path / "whole")
    assert train(whole, "--steps", "60", *DIVERGE).returncode == 0
    expected = (whole / "step_000060.bin").read_bytes()

    # --steps 5: the loss left its band at steps 4 and 5, one short of an incident: nothing is written
    early = seed_data(prepared, tmp_path / "early")
    r = train(early, "--steps", "5", *DIVERGE)
    assert r.returncode == 0 and "not checkpointing step 5" in r.stderr, r.stderr
    assert list(early.glob("step_*.bin")) == []
    assert train(early, "--steps", "60", *DIVERGE).returncode == 0
    assert (early / "step_000060.bin").read_bytes() == expected

    # SIGTERM while the second incident builds up, after the first rollback made its decisions durable
    late = seed_data(prepared, tmp_path / "late")
    t = Trainer(late, "--steps", "60", *DIVERGE, extra_env={"ANDREA_TEST_STEP_DELAY": "0.3"})
    try:
        t.wait_for(lambda line: "guard: rolled back from step" in line, timeout=120)
        first = next(i for i, line in enumerate(t.lines) if "rolled back" in line)
        t.wait_for(lambda line: "guard: step" in line and "(2 of the last" in line and t.lines.index(line) > first)
        t.proc.send_signal(signal.SIGTERM)
        assert t.wait_exit(60) == 0
    finally:
        t.kill()
    out = t.output()
    assert "SIGTERM during an incident" in out and "writing nothing" in out, out
    assert sorted(p.name for p in late.glob("step_*.bin")) == ["step_000000.bin"]
    r = train(late, "--steps", "60", *DIVERGE)
    assert r.returncode == 0, r.stderr
    assert (late / "step_000060.bin").read_bytes() == expected
    assert (late / "step_000060.guard.json").read_bytes() == (whole / "step_000060.guard.json").read_bytes()


@pytest.mark.slow
def test_defaults_never_trigger_on_the_tiny_whole_schedule():
    """bench/guard.py: the tiny preset's whole schedule (2000 steps) with the default [guard]: zero incidents."""
    r = subprocess.run([sys.executable, "bench/guard.py", "--preset", "andrea-tiny"], cwd=ROOT, env=env(),
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| andrea-tiny | 2000 |" in r.stdout and "| 0 | 0 |" in r.stdout, r.stdout
