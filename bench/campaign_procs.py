"""The campaign's processes (bench/campaign.py): andrea commands forked from the warm launcher, torchrun jobs as
subprocesses, each with its output in a log file, a pid to signal, and a bounded wait.

- `Zygote`: the client of bench/campaign_zygote.py (one per campaign): `spawn(argv, env, log)` -> `Proc`.
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
import sys
import threading
import time
from pathlib import Path

from tests.runs import ROOT, env


class Proc:
    """A started process: its pid, exit status (set by the launcher's report or by waitpid), and log."""

    def __init__(self, pid: int, log: Path, argv: list[str], popen: subprocess.Popen | None = None):
        self.pid, self.log, self.argv, self.popen = pid, log, argv, popen
        self.rc: int | None = None
        self.spawned = time.time()
        self.ended: float | None = None
        self.done = threading.Event()
        self.signals: list[str] = []

    def poll(self) -> int | None:
        if self.popen is not None and self.rc is None and self.popen.poll() is not None:
            self.rc = self.popen.returncode
            self.ended = time.time()
            self.done.set()
        return self.rc

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None when the process still runs after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            self.done.wait(0.02)
        return self.rc

    def signal(self, sig: int) -> None:
        if self.poll() is not None:
            return
        self.signals.append(signal.Signals(sig).name)
        try:
            if self.popen is not None and sig == signal.SIGKILL:
                os.killpg(self.pid, sig)  # a torchrun job: the machine's crash takes every worker
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def kill_all(self) -> None:
        """End a process that outlived its bound (a hang), and its workers."""
        try:
            os.killpg(self.pid, signal.SIGKILL) if self.popen is not None else os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.wait(30)

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Zygote:
    """bench/campaign_zygote.py, started once: every andrea command forks from it (no torch import per start)."""

    def __init__(self, extra_env: dict[str, str]):
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.campaign_zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env={**env(), **extra_env}, cwd=ROOT, text=True,
                                     bufsize=1)
        if self.proc.stdout.readline().strip() != "warm":
            raise SystemExit("the campaign's launcher (bench/campaign_zygote.py) did not start")
        self.lock = threading.Lock()
        self.by_id: dict[int, Proc] = {}
        self.by_pid: dict[int, Proc] = {}
        self.spawned: dict[int, threading.Event] = {}
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            word, a, b = line.split()
            with self.lock:
                if word == "spawned":
                    p = self.by_id[int(a)]
                    p.pid = int(b)
                    self.by_pid[p.pid] = p
                    self.spawned[int(a)].set()
                elif word == "exit":
                    p = self.by_pid.pop(int(a), None)
                    if p is not None:
                        p.rc = int(b)
                        p.ended = time.time()
                        p.done.set()

    def spawn(self, argv: list[str], extra_env: dict[str, str], log: Path) -> Proc:
        with self.lock:
            i = self.next_id
            self.next_id += 1
            p = Proc(-1, log, argv)
            self.by_id[i] = p
            self.spawned[i] = threading.Event()
        req = {"id": i, "argv": argv, "env": {**env(), **extra_env}, "cwd": str(ROOT), "log": str(log)}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        if not self.spawned[i].wait(60):
            raise RuntimeError("the campaign's launcher did not fork")
        p.spawned = time.time()
        return p

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def launch(argv: list[str], extra_env: dict[str, str], log: Path) -> Proc:
    """A subprocess in its own process group (a torchrun job), its output in `log`."""
    with open(log, "ab") as f:
        popen = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 env={**env(), **extra_env}, cwd=ROOT, start_new_session=True)
    return Proc(popen.pid, log, argv, popen)


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
