"""The campaign's processes (bench/campaign.py): andrea commands forked from the warm launcher, torchrun jobs as
subprocesses, each with its output in a log file, a pid to signal, and a bounded wait.

- `Zygote`: the campaign's tests/zygote.py launcher (one per campaign): `spawn(argv, env, log)` -> `Proc`.
- `Proc`: one andrea process (or a torchrun job: its launcher and workers in one process group), `signal`,
  `poll`, `wait(timeout)`, `output()`.
- `last_entry`: the ledger's last complete line, parsed (what a strike waits on).
Writes only the logs it is given.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from tests import zygote
from tests.runs import ROOT, env


class Proc:
    """A started process: its pid, exit status (read from `popen`: a subprocess.Popen, or a forked child read like
    one), and log. `group`: a torchrun job, its own process group (a SIGKILL takes every worker)."""

    def __init__(self, log: Path, argv: list[str], popen, group: bool = False):
        self.pid, self.log, self.argv, self.popen, self.group = popen.pid, log, argv, popen, group
        self.rc: int | None = None
        self.spawned = time.time()
        self.ended: float | None = None
        self.signals: list[str] = []

    def poll(self) -> int | None:
        if self.rc is None and self.popen.poll() is not None:
            self.rc = self.popen.returncode
            self.ended = time.time()
        return self.rc

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None when the process still runs after `timeout` seconds."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        return self.poll()

    def signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        self.signals.append(signal.Signals(sig).name)
        try:
            if self.group and sig == signal.SIGKILL:
                os.killpg(self.pid, sig)  # a torchrun job: the machine's crash takes every worker
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill_all(self) -> None:
        """End a process that outlived its bound (a hang), and its workers."""
        try:
            os.killpg(self.pid, signal.SIGKILL) if self.group else os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.wait(30)

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Zygote:
    """tests/zygote.py, started once: every andrea command forks from it (no torch import per start); `extra_env`
    goes to every command."""

    def __init__(self, extra_env: dict[str, str]):
        self.extra_env = extra_env
        try:
            self.launcher = zygote.Zygote(env(), ROOT)
        except RuntimeError as e:
            raise SystemExit(f"the campaign's launcher: {e}") from None

    def spawn(self, argv: list[str], extra_env: dict[str, str], log: Path) -> Proc:
        return Proc(log, argv, self.launcher.spawn(argv, {**env(), **self.extra_env, **extra_env}, log))

    def close(self) -> None:
        self.launcher.close()


def launch(argv: list[str], extra_env: dict[str, str], log: Path) -> Proc:
    """A subprocess in its own process group (a torchrun job), its output in `log`."""
    with open(log, "ab") as f:
        popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**env(), **extra_env}, cwd=ROOT, start_new_session=True)
    return Proc(log, argv, popen, group=True)



def last_entry(ledger: Path) -> dict | None:
    """The ledger's last complete line as an entry, or None (no file, a marker-free tail that is not JSON)."""
    try:
        with open(ledger, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4096))
            tail = f.read()
    except OSError:
        return None
    lines = tail.split(b"\n")[:-1]
    if not lines:
        return None
    try:
        e = json.loads(lines[-1])
    except ValueError:
        return None
    return e if isinstance(e, dict) else None
