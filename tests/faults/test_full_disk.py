"""Full disk: a real trainer on a size-limited tmpfs (and, always, ENOSPC injected in-process at the write call).

Documented behaviour (checkpoint.on_write_error): "retry" logs the error, keeps training and tries again at the
next cadence; a failed FINAL checkpoint exits 1 with the reason; "stop" exits 1 at once. In every case the
previous checkpoint stays intact, no half-written file is left behind under a checkpoint name, and the ledger
neither tears nor loses a line.
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import andrea
from andrea.control.commit.writer import CheckpointWriter
from andrea.rundir import checkpoint as ckpt, names
from andrea.rundir.checkpoint_write import commit_checkpoint
from andrea.rundir.retention import Policy, Retention
from tests.faults.conftest import remount_size
from tests.faults.harness import (REPORT, check_ledger, checkpoint_problems, first_line_with, last_error_line,
                                  newest_committed, stale_tmp)
from tests.disks import fill_to_the_last_byte
from tests.runs import ROOT, Trainer, env, launcher_argv, seed_data, train

ENOSPC_TEXT = os.strerror(errno.ENOSPC)
PACKAGE = Path(andrea.__file__).resolve().parent  # andrea's own code, wherever the checkout lives


def andrea_frames(text: str) -> list[str]:
    """The traceback frames in `text` that run andrea's own code: files inside its package directory, as the
    interpreter reports them, symbolic links resolved. A path that merely passes through a directory named
    `andrea` (a checkout cloned as andrea/, its .venv with torchrun's own traceback) is not one."""
    files = re.findall(r'File "([^"]+)", line \d+', text)  # torchrun prefixes a worker's lines with [rankN]:
    return [f for f in files if Path(f).resolve().is_relative_to(PACKAGE)]


def _seeded_bytes(prepared: Path) -> int:
    return (prepared / "tokenizer.json").stat().st_size + sum(p.stat().st_size for p in (prepared / "data").iterdir())


def _one_and_a_half_checkpoints(prepared: Path, n: int) -> int:
    """Room for the data, one checkpoint and its sidecars, but not for a second checkpoint's temporary file."""
    return _seeded_bytes(prepared) + ckpt.checkpoint_bytes(n) * 3 // 2 + (256 << 10)


def test_full_disk_retry_logs_the_error_keeps_training_and_a_failed_final_write_exits_1(prepared, tmpfs, n_params):
    run = seed_data(prepared, tmpfs(_one_and_a_half_checkpoints(prepared, n_params)))
    result = train(run, "--steps", "30", "--checkpoint-every", "10")
    message = last_error_line(result.stderr)
    REPORT.note("full disk", f"tmpfs, retry: exit {result.returncode}; {message[:200]}")
    assert result.returncode == 1, result.stderr[-3000:]
    assert message.startswith("andrea: error: ") and "step_000030.bin" in message and ENOSPC_TEXT in message, message
    error20 = first_line_with(result.stderr, "step_000020.bin: checkpoint write failed")
    assert " ERROR " in error20 and ENOSPC_TEXT in error20, result.stderr[-3000:]
    assert [p.name for _, p in ckpt.list_checkpoints(run)] == ["step_000010.bin"]
    assert not checkpoint_problems(run, n_params)
    assert not list(run.glob("step_*.bin.tmp")), "a half-written checkpoint was left behind"
    led = check_ledger(run, 30)  # training went on to 30 after the failed write at 20
    assert led.ok, (led.broken, led.lost[:10], led.doubled[:10])


def test_full_disk_with_the_stop_policy_exits_1_at_the_first_failed_write(prepared, tmpfs, n_params):
    run = seed_data(prepared, tmpfs(_one_and_a_half_checkpoints(prepared, n_params)))
    result = train(run, "--steps", "1000", "--checkpoint-every", "10", "--set", 'checkpoint.on_write_error="stop"')
    message = last_error_line(result.stderr)
    REPORT.note("full disk", f"tmpfs, stop: exit {result.returncode}; {message[:200]}")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "step_000020.bin" in message and ENOSPC_TEXT in message, message
    led = check_ledger(run, 10)
    assert led.ok, (led.broken, led.lost[:10])
    assert max(e["step"] for e in led.entries if "event" not in e) < 40, "kept training after the failed write"
    assert newest_committed(run) == 10 and not checkpoint_problems(run, n_params)
    assert not list(run.glob("step_*.bin.tmp"))


def test_andrea_frames_are_the_packages_own_code_not_a_directory_named_andrea(tmp_path):
    """The traceback check must hold in a checkout cloned as andrea/ (issue #21): torchrun's own frames in
    andrea/.venv are not andrea's; a worker's frames in the package are, even reached through a symbolic link."""
    venv_frame = tmp_path / "andrea" / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "run.py"
    (tmp_path / "link").symlink_to(PACKAGE)
    torchrun = f'Traceback (most recent call last):\n  File "{venv_frame}", line 8, in <module>\n    main()\n'
    worker = (f'[rank1]: Traceback (most recent call last):\n[rank1]:   File "<frozen runpy>", line 198, in _run\n'
              f'[rank1]:   File "{tmp_path / "link" / "cli.py"}", line 12, in main\n[rank1]:     run()\n')
    assert andrea_frames(torchrun) == []
    assert andrea_frames(worker) == [str(tmp_path / "link" / "cli.py")]
    assert andrea_frames(f'  File "{PACKAGE / "control" / "runtime.py"}", line 3, in loop\n') != []


def test_full_disk_under_torchrun_with_the_stop_policy_ends_every_worker_with_the_error(prepared, tmpfs, n_params):
    """Two ranks: the failure reaches each rank's event loop at its own moment, and the boundary exchange makes
    them stop together (ranks.py): each worker exits with the error line, none is left in a collective."""
    run = seed_data(prepared, tmpfs(_one_and_a_half_checkpoints(prepared, n_params)))
    result = subprocess.run(launcher_argv(run, "--steps", "1000", "--checkpoint-every", "10", "--set",
                                          'checkpoint.on_write_error="stop"'),
                            capture_output=True, text=True, timeout=300, env=env(), cwd=ROOT)
    errors = [line for line in result.stderr.splitlines() if line.startswith("andrea: error: ")]
    REPORT.note("full disk", f"tmpfs, 2 ranks, stop: exit {result.returncode}; {errors[:1]}")
    assert result.returncode != 0
    assert len(errors) == 2, result.stderr[-4000:]  # one per worker
    assert all("step_000020.bin" in e for e in errors), errors
    assert not andrea_frames(result.stderr), result.stderr[-4000:]  # no worker's traceback
    led = check_ledger(run, 10)
    assert led.ok, (led.broken, led.lost[:10])
    assert max(e["step"] for e in led.entries if "event" not in e) < 40, "kept training after the failed write"
    assert newest_committed(run) == 10 and not checkpoint_problems(run, n_params)
    assert not list(run.glob("step_*.bin.tmp"))


def test_after_space_is_freed_the_next_cadence_commits_and_sigterm_exits_0(prepared, tmpfs, launch, n_params):
    disk = tmpfs(_one_and_a_half_checkpoints(prepared, n_params))
    run = seed_data(prepared, disk)
    t = launch(run, "--steps", "10000000", "--checkpoint-every", "10")
    t.wait_ready()
    t.wait_for(lambda l: "checkpoint write failed" in l, 60)
    assert t.proc.poll() is None, "a failed write under the retry policy stopped training"
    remount_size(disk, _seeded_bytes(prepared) + 8 * ckpt.checkpoint_bytes(n_params))
    line = t.wait_for(lambda l: "committed" in l and "step_000010.bin" not in l, 60)
    t.proc.send_signal(signal.SIGTERM)
    assert t.wait_exit(60) == 0, t.output()
    REPORT.note("full disk", f"tmpfs grown after a failed write: {line.split(': ', 1)[-1]}; SIGTERM exit 0")
    assert not checkpoint_problems(run, n_params) and newest_committed(run) > 20
    led = check_ledger(run, newest_committed(run))
    assert led.ok, (led.broken, led.lost[:10], led.doubled[:10])


@pytest.fixture(scope="module")
def disk_filled_mid_run(prepared, tmp_path_factory, n_params):
    """A trainer whose disk fills to the last byte mid-run (ledger appends fail too), then frees, then SIGTERM."""
    disk = tmp_path_factory.mktemp("filled") / "disk"
    disk.mkdir()
    size = _seeded_bytes(prepared) + 4 * ckpt.checkpoint_bytes(n_params)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size // 1024}k", "tmpfs", str(disk)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}); see the in-process ENOSPC test")
    t = None
    try:
        run = seed_data(prepared, disk)
        t = Trainer(run, "--steps", "10000000", "--checkpoint-every", "10", "--set", "checkpoint.keep_last=1")
        t.wait_ready()
        t.wait_for(lambda l: "step_000010.bin committed" in l, 60)
        filler = fill_to_the_last_byte(disk)
        failed = t.wait_for(lambda l: "checkpoint write failed" in l, 60)
        failed_step = names.step_of(failed.split(": checkpoint")[0].rsplit("/", 1)[-1])
        t.wait_for(lambda l: f"step {failed_step + 20}/" in l or f"step_{failed_step + 10:06d}.bin" in l, 60)
        filler.unlink()
        t.wait_for(lambda l: "committed" in l and names.checkpoint_name(failed_step) < l.split("checkpoint ")[-1], 60)
        t.proc.send_signal(signal.SIGTERM)
        rc = t.wait_exit(60)
        REPORT.note("full disk", f"disk filled to the last byte mid-run (ledger too), then freed: exit {rc}; "
                                 f"ledger errors logged: {sum('.loss.json' in l and 'ERROR' in l for l in t.lines)}; "
                                 f"leftover temporary files: {stale_tmp(run)[:4]}")
        yield run, rc, t
    finally:
        if t is not None:
            t.kill()
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def test_a_disk_full_to_the_last_byte_never_tears_or_silently_drops_ledger_lines(disk_filled_mid_run, n_params):
    run, rc, t = disk_filled_mid_run
    assert rc == 0, t.output()
    assert not checkpoint_problems(run, n_params)
    led = check_ledger(run, newest_committed(run))
    assert led.broken is None, f"the full disk tore a line in the middle of the ledger: {led.broken}"
    assert not led.lost, (f"{len(led.lost)} ledger entries at or before checkpoint {newest_committed(run)} were "
                          f"silently lost while the disk was full: {led.lost[:10]}…")


def test_a_full_disk_leaves_no_temporary_files_behind_after_a_clean_exit(disk_filled_mid_run):
    run, rc, t = disk_filled_mid_run
    assert not stale_tmp(run), f"temporary files left by failed writes: {stale_tmp(run)}"


# --- ENOSPC injected in-process (works without mount privileges) --------------------------------------------------
def _payload(n: int, seed: int) -> np.ndarray:
    p = np.random.default_rng(seed).standard_normal(3 * n).astype(np.float32)
    p[2 * n:] = np.abs(p[2 * n:])  # v >= 0
    return p


def test_enospc_at_the_write_call_fails_the_commit_cleanly_and_the_next_commit_succeeds(tmp_path, monkeypatch):
    n = 1000
    old = commit_checkpoint(tmp_path, 10, _payload(n, 1))
    old_bytes = old.read_bytes()
    real_pwrite = os.pwrite
    full = {"on": True}

    def pwrite(fd, data, offset):
        if full["on"] and len(data) > 8:  # the header fits, the payload does not: a partial file
            raise OSError(errno.ENOSPC, ENOSPC_TEXT)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    io = ThreadPoolExecutor(1)

    async def commit(*steps: int):
        """One writer committing `steps` in turn, each awaited (the callbacks that record a result run)."""
        writer = CheckpointWriter(tmp_path, n, torch.device("cpu"), io, retention=Retention(Policy(5, 0)))
        for step in steps:
            writer.staging[0].copy_(torch.from_numpy(_payload(n, step)))
            await writer.start_commit(0, step, None)
            await asyncio.sleep(0)
        return writer

    writer = asyncio.run(commit(20, 25))
    REPORT.note("full disk", f"in-process ENOSPC at os.pwrite: {writer.first_error}")
    # the first failure is the one named, also once a later one has failed (on_write_error = "stop" reports it)
    assert writer.first_error and "step_000020.bin" in writer.first_error and ENOSPC_TEXT in writer.first_error
    assert writer.last_committed is None
    assert old.read_bytes() == old_bytes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010.bin", "step_000010.sum.json"], \
        "a half file was left behind"
    full["on"] = False
    writer = asyncio.run(commit(30))
    io.shutdown()
    assert writer.first_error is None and writer.last_committed == 30
    assert not checkpoint_problems(tmp_path, n)
