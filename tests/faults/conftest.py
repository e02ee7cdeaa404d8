"""Fixtures of the fault suite (live-process cleanup, tmpfs mounts, a trained run to corrupt) and its one table.

The table (trials, kills, torn checkpoints, lost ledger lines, every bad input and its message) is printed by
`pytest_terminal_summary`, so it appears under -q as well. ANDREA_FAULT_KILLS sets the kill campaign's size.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.faults.harness import REPORT, tiny_n_params
from tests.runs import Trainer, seed_data, train

FAULT_KILLS = int(os.environ.get("ANDREA_FAULT_KILLS", "14") or 14)  # make test: each kind of moment twice; make faults: 200


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if REPORT.empty():
        return
    terminalreporter.write_sep("=", f"andrea fault table (ANDREA_FAULT_KILLS={FAULT_KILLS})")
    for line in REPORT.lines():
        terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def n_params() -> int:
    return tiny_n_params()


@pytest.fixture
def live():
    """Start trainers through this list; whatever is still running at teardown is SIGKILLed and reaped."""
    started: list[Trainer] = []
    yield started
    for t in started:
        t.kill()


@pytest.fixture
def launch(live):
    def start(run_dir: Path, *args: str, extra_env: dict | None = None, fresh: bool = False) -> Trainer:
        t = Trainer(run_dir, *args, extra_env=extra_env, fresh=fresh)
        live.append(t)
        return t
    return start


@pytest.fixture(scope="session")
def trained(prepared, tmp_path_factory) -> Path:
    """A tiny run stopped at step 20 with checkpoints at 10 and 20 (and their state files); copy, never touch."""
    run_dir = seed_data(prepared, tmp_path_factory.mktemp("trained") / "run")
    result = train(run_dir, "--steps", "20", "--checkpoint-every", "10")
    assert result.returncode == 0, result.stderr
    assert (run_dir / "step_000010.bin").exists() and (run_dir / "step_000020.bin").exists()
    return run_dir


@pytest.fixture
def trained_copy(trained, tmp_path) -> Path:
    dest = tmp_path / "run"
    shutil.copytree(trained, dest)
    return dest


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@pytest.fixture
def tmpfs(tmp_path, live):
    """mount(size_bytes) -> a fresh size-limited tmpfs; skips (saying why) when mounting is not allowed."""
    mounted: list[Path] = []

    def mount(size_bytes: int, name: str = "disk") -> Path:
        where = tmp_path / name
        where.mkdir()
        r = _mount("-t", "tmpfs", "-o", f"size={size_bytes // 1024}k", "tmpfs", str(where))
        if r.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); the in-process ENOSPC tests in "
                        "test_full_disk.py cover the write path instead")
        mounted.append(where)
        return where

    yield mount
    for t in live:
        t.kill()
    for where in reversed(mounted):
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


def remount_size(where: Path, size_bytes: int) -> None:
    r = _mount("-o", f"remount,size={size_bytes // 1024}k", str(where))
    assert r.returncode == 0, r.stderr


@pytest.fixture
def readonly_view(tmp_path):
    """readonly(src) -> a read-only bind mount of src; skips (saying why) when mounting is not allowed."""
    mounted: list[Path] = []

    def readonly(src: Path) -> Path:
        where = tmp_path / "ro"
        where.mkdir()
        r = _mount("--bind", str(src), str(where))
        if r.returncode == 0:
            mounted.append(where)
            r = _mount("-o", "remount,ro,bind", str(where))
        if r.returncode != 0:
            pytest.skip(f"cannot make a read-only bind mount here ({r.stderr.strip()}); as root, chmod alone "
                        "does not stop writes, so a not-writable run directory cannot be produced")
        return where

    yield readonly
    for where in mounted:
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)
