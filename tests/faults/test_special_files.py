"""Something that is not a regular file where a run file belongs (a FIFO, a directory): every command refuses it in
one line naming it, exits non-zero within seconds and changes nothing (rundir/regular.py, rundir/inspect.py's
`special_files`); and a stop asked for while a start is blocked for good still ends the process in bounded time
(control/run/start_deadline.py). Each command runs as a real process under a timeout, so a hang fails the test
instead of holding the suite."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.runs import TINY, Trainer, andrea, andrea_here, seed_data

NAMES = ["step_000020.sum.json", ".loss.json", ".state.json", ".samples.json", "run.toml", "step_000020.bin",
         "step_000020.guard.json", "step_000020.state.json", "step_000020.ledger.json", "tokenizer.json",
         "data/manifest.json"]
COMMANDS = {
    "train": lambda run, tmp: ["train", *TINY, "--run-dir", str(run), "--steps", "30"],
    "status": lambda run, tmp: ["status", str(run)],
    "verify": lambda run, tmp: ["verify", str(run)],
    "export": lambda run, tmp: ["export", str(run), "--out", str(tmp / "hf")],
}
TIMEOUT_S = 60


def bounded(command: str, argv: list[str]) -> subprocess.CompletedProcess | None:
    """`andrea ARGV`'s result, or None when it is still running after TIMEOUT_S: train as a process (killed then),
    the read-only commands in this process on a daemon thread (left blocked then; the test fails)."""
    if command == "train":
        try:
            return andrea(*argv, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return None
    out: list = []
    worker = threading.Thread(target=lambda: out.append(andrea_here(*argv)), daemon=True)
    worker.start()
    worker.join(TIMEOUT_S)
    return out[0] if out else None


KIND_WORDS = {"fifo": "a FIFO (named pipe), not a regular file", "dir": "a directory, not a regular file"}


def snapshot(run: Path) -> tuple[dict, list]:
    """The regular files' digests, and every entry's name and type (a FIFO stays a FIFO)."""
    kinds = sorted((str(p.relative_to(run)), stat.S_IFMT(p.lstat().st_mode)) for p in run.rglob("*"))
    regular = {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest() for p in run.rglob("*")
               if stat.S_ISREG(p.lstat().st_mode)}
    return regular, kinds


@pytest.mark.parametrize("kind,name", [("fifo", n) for n in NAMES] + [("dir", "step_000020.sum.json"),
                                                                     ("dir", ".loss.json")])
def test_a_special_file_at_a_run_file_name_is_refused_by_every_command_in_one_line(trained, tmp_path, kind, name):
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    (run / name).unlink()
    os.mkfifo(run / name) if kind == "fifo" else (run / name).mkdir()
    before = snapshot(run)
    for command, argv in COMMANDS.items():
        result = bounded(command, argv(run, tmp_path))
        if result is None:
            pytest.fail(f"{command} with {kind} at {name}: still running after {TIMEOUT_S} s")
        errors = [line for line in result.stderr.splitlines() if line.startswith("andrea: error:")]
        assert result.returncode != 0, (command, result.stdout[-400:], result.stderr[-800:])
        assert len(errors) == 1 and errors[0].startswith(f"andrea: error: {run / name}: ") and \
            KIND_WORDS[kind] in errors[0], (command, result.stderr[-800:])  # run.toml's: "cannot read config: a FIFO"
        assert "Traceback" not in result.stderr
        assert snapshot(run) == before, f"{command} changed the run directory"
        assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("where", ["start@0", "start@1"])
def test_sigterm_during_a_start_blocked_for_good_ends_it_in_bounded_time(prepared, tmp_path, where):
    """The start blocks for good (ANDREA_TEST_HANG, as a read of a hung disk would) in its data preparation on the
    training thread (start@0), or on the event loop's own thread before the checkpoint is read (start@1, where the
    loop's signal handler never runs): the stop recorded at SIGTERM has no point at which to be honoured. The
    start's deadline (here 2 s) ends the process with 143 and one line saying where it was blocked. Before it,
    SIGTERM was absorbed for good."""
    run = seed_data(prepared, tmp_path / "run")
    trainer = Trainer(run, "--steps", "5", extra_env={"ANDREA_TEST_HANG": where, "ANDREA_TEST_START_GRACE": "2"})
    try:
        trainer.wait_for(lambda line: f"ANDREA_TEST_HANG={where}" in line, timeout=120)
        trainer.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            rc = trainer.wait_exit(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("SIGTERM during a blocked start: still running 30 s later")
        took = time.monotonic() - t0
    finally:
        trainer.kill()
    assert rc == 143, trainer.output()[-800:]
    assert took < 15, took
    assert "andrea: SIGTERM received 2 s ago and the start is still blocked" in trainer.output(), trainer.output()
