"""Helpers for tests that drive real `python -m andrea` processes on the tiny preset.

Each `python -m andrea` (`andrea`, `train`, `Trainer`) is forked from a warm interpreter (tests/zygote.py: one per
test process, started at its first use) unless its environment changes something read at import (then it is started
afresh, as it is for every start under `ANDREA_TESTS_FRESH=1`): a fork spares the ~2 s of CPU a start spends
importing torch, and is otherwise the same process. Output goes through files in a temporary folder of the test
process, removed at its exit.

The first start of a run trains a tokenizer and tokenizes the corpus; `seeded_run_dir` copies a prepared
`tokenizer.json` and `data/` (made once per session, exactly as a first start makes them) so each test pays
only for what it tests.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import io
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from tests.zygote import Zygote, import_time

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--preset", "andrea-tiny"]
# The variables read at import as this test process found them (tests/conftest.py has chosen TRITON_INTERPRET).
# A test that compiles in process leaves torch.compile's TORCHINDUCTOR_CACHE_DIR in os.environ: this process's, not
# its children's, and with it every later start of this test process would differ from the zygote's at import and
# start afresh (most of a `make test`'s 99 fresh starts, ~2.7 CPU-s each, 2026-12-06).
_IMPORT_TIME_AT_START = import_time(dict(os.environ))


def env() -> dict[str, str]:
    """The environment of a process a test starts: this one's, with the variables read at import as they were when
    this process started (`_IMPORT_TIME_AT_START`), PYTHONPATH at the checkout, one torch thread."""
    now = dict(os.environ)
    read_at_import = import_time(now)
    e = {k: v for k, v in now.items() if k not in read_at_import} | _IMPORT_TIME_AT_START
    e["PYTHONPATH"] = str(ROOT)
    e.setdefault("OMP_NUM_THREADS", "1")  # equal thread counts across processes: equal float summation order
    return e


class _Launcher:
    """This test process's zygote and the folder its children's output files go to, made at first use."""

    def __init__(self):
        self.lock = threading.Lock()
        self.zygote: Zygote | None = None
        self.folder: Path | None = None
        self.count = 0

    def serving(self, environment: dict[str, str]) -> Zygote | None:
        """The zygote, when a process with this environment may fork from it (else: start it afresh)."""
        if os.environ.get("ANDREA_TESTS_FRESH"):
            return None
        with self.lock:
            if self.zygote is None or self.zygote.proc.poll() is not None:
                self.zygote = Zygote(env(), ROOT)
                self.folder = Path(tempfile.mkdtemp(prefix="andrea-forks-"))
                atexit.register(self.close)
            return self.zygote if self.zygote.serves(environment) else None

    def files(self, *names: str) -> list[Path]:
        with self.lock:
            self.count += 1
            return [self.folder / f"{self.count}.{name}" for name in names]

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()
            shutil.rmtree(self.folder, ignore_errors=True)
            self.zygote = None


LAUNCHER = _Launcher()


def _read(path: Path) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:  # universal newlines, as subprocess's text=True
        return f.read()


def andrea(*args: str, timeout: float = 300, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m andrea ARGS` to its end: exit code, stdout and stderr, as subprocess.run(capture_output=True)."""
    environment = {**env(), **(extra_env or {})}
    argv = [sys.executable, "-m", "andrea", *args]
    zygote = LAUNCHER.serving(environment)
    if zygote is None:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=environment, cwd=ROOT)
    out, err = LAUNCHER.files("out", "err")
    p = zygote.spawn(list(args), environment, out, err)
    try:
        try:
            rc = p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)
            raise subprocess.TimeoutExpired(argv, timeout, output=_read(out), stderr=_read(err)) from None
        return subprocess.CompletedProcess(argv, rc, _read(out), _read(err))
    finally:
        out.unlink(missing_ok=True)
        err.unlink(missing_ok=True)


def popen(args: list[str], environment: dict[str, str], fresh: bool = False):
    """`python -m andrea ARGS` running, stdout and stderr merged: a Popen, or a tests.zygote.Forked read like one.
    `fresh`: a new interpreter whatever the environment (a test of the start itself: a signal during the imports)."""
    zygote = None if fresh else LAUNCHER.serving(environment)
    if zygote is None:
        return subprocess.Popen([sys.executable, "-m", "andrea", *args], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=environment, cwd=ROOT)
    return zygote.spawn(args, environment, *LAUNCHER.files("log"))


def andrea_here(*args: str) -> subprocess.CompletedProcess:
    """`andrea ARGS` run by cli.main() in this process, its exit code, stdout and stderr captured as andrea() returns
    them: for commands that only read a run or refuse one (verify, status, info), where a subprocess would spend
    ~2 s of CPU importing torch. Never for a command that trains or prepares data, or that could on a regression.
    Log records go to pytest's handlers, not to the captured stderr: assert on the error line, not on a count of
    stderr lines."""
    from andrea import cli
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(list(args))
        except SystemExit as e:  # argparse refusing the arguments
            rc = e.code
    return subprocess.CompletedProcess(["andrea", *args], rc, out.getvalue(), err.getvalue())


def train(run_dir: Path, *args: str, timeout: float = 300, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    return andrea("train", *TINY, "--run-dir", str(run_dir), *args, timeout=timeout, extra_env=extra_env)


def launcher_argv(run_dir: Path, *args: str, nproc: int = 2, launch: tuple = ()) -> list[str]:
    """`torchrun` (as `python -m torch.distributed.run`) training the tiny preset in `run_dir`, one node by
    default."""
    launch = launch or ("--standalone", f"--nproc_per_node={nproc}")
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "andrea", "train", *TINY,
            "--run-dir", str(run_dir), *args]


def seed_data(template: Path, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(template / "tokenizer.json", run_dir / "tokenizer.json")
    shutil.copytree(template / "data", run_dir / "data", dirs_exist_ok=True)
    return run_dir


def ledger(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / ".loss.json").read_text().splitlines() if line]


def steps_in_ledger(run_dir: Path) -> list[int]:
    return [e["step"] for e in ledger(run_dir) if "event" not in e]


def tree_digest(run_dir: Path) -> dict[str, str]:
    """sha256 of every file under run_dir, by relative path (what "unchanged" means for an error path)."""
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


def header(path: Path) -> tuple[int, int]:
    step, n = np.fromfile(path, dtype="<i4", count=2)
    return int(step), int(n)


def free_port() -> int:
    """A port free on the loopback now (a torchrun rendezvous's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    """A live trainer subprocess whose output lines are read on a thread (no blocking reads in tests)."""

    def __init__(self, run_dir: Path, *args: str, extra_env: dict | None = None, fresh: bool = False):
        self._follow(popen(["train", *TINY, "--run-dir", str(run_dir), *args], {**env(), **(extra_env or {})}, fresh))

    def _follow(self, proc) -> None:
        """Read `proc`'s merged output on a thread from now on."""
        self.proc = proc
        self.lines: list[str] = []
        self._q: queue.Queue[str] = queue.Queue()
        self._pumper = threading.Thread(target=self._pump, daemon=True)
        self._pumper.start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._q.put(line.rstrip("\n"))

    def wait_for(self, predicate, timeout: float = 60.0) -> str:
        """The first output line (past or future) for which predicate(line) holds; fails after timeout."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            while seen < len(self.lines):
                if predicate(self.lines[seen]):
                    return self.lines[seen]
                seen += 1
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no matching line within {timeout}s; output:\n" + "\n".join(self.lines[-40:]))
            try:
                self.lines.append(self._q.get(timeout=min(remaining, 0.5)))
            except queue.Empty:
                if self.proc.poll() is not None and self._q.empty():
                    raise AssertionError("trainer exited:\n" + "\n".join(self.lines[-40:])) from None

    def wait_ready(self, timeout: float = 90.0) -> str:
        return self.wait_for(lambda l: l.startswith("ready "), timeout)

    def wait_exit(self, timeout: float = 60.0) -> int:
        rc = self.proc.wait(timeout)
        self._pumper.join(5)  # the output's last lines
        while not self._q.empty():
            self.lines.append(self._q.get())
        return rc

    def output(self) -> str:
        self.wait_exit(5) if self.proc.poll() is not None else None
        return "\n".join(self.lines)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


class Launched(Trainer):
    """Any command's live output, read like a trainer's: a torchrun launcher and the lines of all its workers."""

    def __init__(self, argv: list[str], extra_env: dict | None = None):
        self._follow(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**env(), **(extra_env or {})}, cwd=ROOT))


def andrea_records(caplog) -> list:
    """The log records andrea's own loggers wrote: caplog holds every logger's, and a library's thread left by an
    earlier test of the same worker (W&B's, after a bounded close) may still write to it."""
    return [r for r in caplog.records if r.name == "andrea" or r.name.startswith("andrea.")]


def wait_until(condition, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
