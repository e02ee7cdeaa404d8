"""`python -m andrea ARGS` forked from one warm interpreter: the launcher of the test suite's and the campaign's
andrea processes (tests/runs.py, bench/campaign_procs.py).

Every andrea start first spends ~2 s of CPU importing torch; the suite makes hundreds of starts and a campaign
thousands. Run as `python -m tests.zygote`, this module is the server: it imports torch and every andrea module once,
says `warm`, then serves requests on stdin (one JSON line each: id, argv, env, cwd, out, err) by forking. The child
points fd 0 at /dev/null and fds 1 and 2 at the request's files (one file when out == err), takes the request's
environment and working directory, and runs `andrea/__main__.py` exactly as `python -m andrea` does (runpy), then
leaves the interpreter the ordinary way (atexit handlers, non-daemon threads joined, the exit status of sys.exit).
The child is a real process: SIGKILL and SIGTERM reach it by its pid. The server reaps its children and reports on
stdout: `spawned <id> <pid>` and `exit <pid> <returncode>` (negative: killed by that signal); when its stdin closes
it SIGKILLs the children still running and exits.

The client, `Zygote`, starts one server and hands back each child as a `Forked`: read like `subprocess.Popen` (pid,
poll, wait, send_signal, kill, returncode; `stdout` iterates the merged output's lines while the process runs).

What differs from a fresh interpreter, and how the client keeps it from mattering: modules are imported before the
child's environment is set, so a request whose environment differs from the server's in anything read at import
(`IMPORT_TIME`: Python's, the thread pools', torch's, Triton's, CUDA's and the loader's variables) is not the
server's to serve: `serves(env)` says so and the caller starts a fresh interpreter instead. andrea itself reads its
variables when called (andrea/testhooks.py). PYTHONFAULTHANDLER is honoured in the child (faulthandler.enable).
Every child shares one PYTHONHASHSEED, so a set-order dependence between processes is not seen. Reads and writes
only the files it is asked for.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

# variables read while torch, numpy, Triton and Python itself start: a request must match the server's in all of them
IMPORT_TIME = ("PYTHON", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "TORCH", "TRITON", "CUDA", "LD_", "MALLOC_")
AT_START = frozenset({"PYTHONFAULTHANDLER"})  # Python reads it at start; the child enables faulthandler itself


# ---------------------------------------------------------------------------------------------------- the server

def warm() -> None:
    """Import what a start imports: torch, numpy and every andrea module (a module that fails to import here is
    left for the child to import, and fail, itself)."""
    import pkgutil

    import numpy  # noqa: F401
    import torch  # noqa: F401

    import andrea
    for info in pkgutil.walk_packages(andrea.__path__, "andrea."):
        if not info.name.endswith("__main__"):
            try:
                __import__(info.name)
            except Exception:  # noqa: BLE001 - the child meets it again, where it counts
                pass


def serve() -> dict | None:
    """Fork one child per request; the child returns its request, the server returns None at end of input."""
    children: set[int] = set()
    buf = b""
    out = sys.stdout
    while True:
        ready, _, _ = select.select([0], [], [], 0.02)
        if ready:
            chunk = os.read(0, 65536)
            if not chunk:
                for pid in children:  # the client is gone: leave nothing behind
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return None
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if not line.strip():
                    continue
                req = json.loads(line)
                out.flush()
                pid = os.fork()
                if pid == 0:
                    return req
                children.add(pid)
                out.write(f"spawned {req['id']} {pid}\n")
                out.flush()
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            out.write(f"exit {pid} {os.waitstatus_to_exitcode(status)}\n")
            out.flush()


def become(req: dict) -> None:
    """In the child: the request's process, `python -m andrea ARGS`."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        if fd == 2 and req["err"] == req["out"]:
            os.dup2(1, 2)
            continue
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.stdout.reconfigure(line_buffering=True)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler
        faulthandler.enable()
    sys.argv = ["andrea", *req["argv"]]
    runpy.run_module("andrea", run_name="__main__", alter_sys=True)


# ---------------------------------------------------------------------------------------------------- the client

def import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and k not in AT_START}


class Forked:
    """A child of the server, read like subprocess.Popen. Its return code arrives with the server's `exit` report."""

    def __init__(self, args: list[str], out: Path, err: Path):
        self.args, self.out, self.err = args, out, err
        self.pid = -1
        self.returncode: int | None = None
        self.ended = threading.Event()
        self.stdout = _Tail(self) if out == err else None

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Tail:
    """The lines of a child's merged output file as it writes them, ending once it has exited and all are read."""

    def __init__(self, proc: Forked):
        self.proc = proc

    def __iter__(self):
        with open(self.proc.out, encoding="utf-8", errors="replace") as f:  # universal newlines, as Popen(text=True)
            pending = ""
            while True:
                ended = self.proc.returncode is not None  # read before the last read: nothing written after it
                pending += f.read()
                *lines, pending = pending.split("\n")
                yield from (line + "\n" for line in lines)
                if ended:
                    if pending:
                        yield pending
                    return
                self.proc.ended.wait(0.02)

    def close(self) -> None:
        pass


class Zygote:
    """One server (`python -m tests.zygote`), started with `env` and `cwd`; `spawn` forks an andrea process from it."""

    def __init__(self, env: dict[str, str], cwd: Path):
        self.env, self.cwd = dict(env), cwd
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=self.env, cwd=cwd, text=True, bufsize=1)
        if self.proc.stdout.readline().strip() != "warm":
            raise RuntimeError("the launcher (tests/zygote.py) did not start")
        self.lock = threading.Lock()
        self.by_id: dict[int, Forked] = {}
        self.by_pid: dict[int, Forked] = {}
        self.forked: dict[int, threading.Event] = {}
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True, name="zygote-reader").start()

    def serves(self, env: dict[str, str]) -> bool:
        """Whether a process with this environment is the same forked from here as started afresh."""
        return self.proc.poll() is None and import_time(env) == import_time(self.env)

    def _read(self) -> None:
        for line in self.proc.stdout:
            word, a, b = line.split()
            with self.lock:
                if word == "spawned":
                    p = self.by_id.pop(int(a))
                    p.pid = int(b)
                    self.by_pid[p.pid] = p
                    self.forked.pop(int(a)).set()
                elif word == "exit":
                    p = self.by_pid.pop(int(a), None)
                    if p is not None:
                        p.returncode = int(b)
                        p.ended.set()

    def spawn(self, argv: list[str], env: dict[str, str], out: Path, err: Path | None = None) -> Forked:
        """`python -m andrea ARGV` with exactly `env`, its stdout in `out` and its stderr in `err` (default: `out`)."""
        err = err or out
        p = Forked(["andrea", *argv], out, err)
        with self.lock:
            i = self.next_id
            self.next_id += 1
            self.by_id[i] = p
            forked = self.forked[i] = threading.Event()
            req = {"id": i, "argv": argv, "env": env, "cwd": str(self.cwd), "out": str(out), "err": str(err)}
            Path(out).touch()
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        if not forked.wait(60):
            raise RuntimeError("the launcher (tests/zygote.py) did not fork")
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


if __name__ == "__main__":
    warm()
    if threading.active_count() > 1:  # a fork copies one thread only: a lock another held stays held
        sys.stderr.write(f"tests/zygote.py: {threading.active_count()} threads after the imports\n")
    sys.stdout.write("warm\n")
    sys.stdout.flush()
    request = serve()
    if request is not None:
        become(request)
