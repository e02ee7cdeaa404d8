"""`andrea prepare` and a first start as a user runs them: idempotent, interruptible, resumable, reported by status."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from andrea.config.corpus import DataConfig, SourceConfig
from andrea.data.preparation import prepare_run
from tests.unit.data.conftest import text
from tests.runs import ROOT, TINY, Trainer, andrea, andrea_here, env, train, wait_until


def notes(tmp_path, n=30):
    src = tmp_path / "notes"
    src.mkdir()
    for i in range(n):
        (src / f"n{i:02d}.txt").write_text(text(i, 60))
    return src


def sources(src) -> list[str]:
    return ["--set", "data.arms=[]", "--set", f"data.sources=[{{name='notes', path='{src}'}}]"]


def token_files(run_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in (run_dir / "data").glob("notes.*.u16")}


def test_prepare_then_prepare_again_then_train_on_it_and_status_reports_the_data(tmp_path):
    src, run = notes(tmp_path, 6), tmp_path / "run"
    first = andrea("prepare", *TINY, "--run-dir", str(run), *sources(src))
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("data prepared 1 arm(s)") and "tokenizer trained" in first.stderr
    before = token_files(run) | {"tokenizer.json": (run / "tokenizer.json").read_bytes()}
    again = andrea("prepare", "--run-dir", str(run))  # run.toml remembers the preset and the sources
    assert again.returncode == 0 and again.stdout.startswith("data already prepared, nothing to do: 1 arm(s)")
    status = json.loads(andrea_here("status", str(run), "--json").stdout)
    assert status["state"] == "prepared" and status["data"]["notes"]["epochs"] == 0.0
    r = train(run, "--steps", "20")
    assert r.returncode == 0, r.stderr
    assert "tokenizer trained" not in r.stderr and "preparing arm" not in r.stderr
    assert token_files(run) | {"tokenizer.json": (run / "tokenizer.json").read_bytes()} == before
    data = json.loads(andrea_here("status", str(run), "--json").stdout)["data"]["notes"]
    assert data["complete"] and data["train_tokens"] > 0 and data["val_tokens"] > 0
    assert data["source_bytes"] == sum(p.stat().st_size for p in src.iterdir()) and data["documents"] == 6
    assert data["epochs"] > 0  # the bandit's pulls x block_size over the arm's training tokens


def test_sigterm_during_prepare_stops_at_once_exit_0_and_the_rerun_ends_byte_identical(tmp_path):
    src, run = notes(tmp_path), tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "andrea", "prepare", *TINY, "--run-dir", str(run), *sources(src)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**env(), "ANDREA_TEST_FILE_DELAY": "0.3"})  # 30 files: a 9 s window
    try:
        wait_until(lambda: (run / "tokenizer.json").exists() and (run / "data" / "notes.plan.json").exists(), 60,
                   "the arm's encoding to begin (the tokenizer trained)")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "SIGTERM received: stopping data preparation" in err and "preparation stopped at arm 'notes'" in out
    cursor = json.loads((run / "data" / "manifest.json").read_text())["arms"]["notes"]["cursor"]
    assert 0 <= cursor["file"] < 30
    assert json.loads(andrea_here("status", str(run), "--json").stdout)["state"] == "preparing"
    r = andrea("prepare", "--run-dir", str(run))
    assert r.returncode == 0 and r.stdout.startswith("data prepared 1 arm(s)"), r.stderr
    prepare_run(DataConfig(arms=[], sources=[SourceConfig("notes", str(src))]), tmp_path / "straight", 512)
    assert token_files(run) == token_files(tmp_path / "straight")


def test_sigterm_during_a_first_start_preparation_exits_0_without_a_checkpoint_and_the_next_start_trains(tmp_path):
    src, run = notes(tmp_path), tmp_path / "run"
    t = Trainer(run, "--steps", "5", *sources(src), extra_env={"ANDREA_TEST_FILE_DELAY": "0.3"})
    try:
        wait_until(lambda: (run / "tokenizer.json").exists() and (run / "data" / "notes.plan.json").exists(), 60,
                   "the arm's encoding to begin (the tokenizer trained)")
        t.proc.send_signal(signal.SIGTERM)
        assert t.wait_exit(30) == 0
    finally:
        t.kill()
    out = t.output()
    assert "stopping data preparation" in out and "preparation stopped at arm 'notes'" in out, out
    assert not list(run.glob("step_*.bin"))
    r = train(run, "--steps", "5", *sources(src))
    assert r.returncode == 0, r.stderr
    assert (run / "step_000005.bin").exists()
