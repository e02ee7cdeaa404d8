"""The campaign's process launcher (bench/campaign.py): `python -m andrea ARGS` forked from one warm interpreter.

Every andrea start first spends ~2-4 s of CPU importing torch; a campaign makes thousands of starts. This process
imports torch and andrea's command modules once, then serves requests on stdin (one JSON line each: argv, env,
cwd, log) by forking: the child points fds 0-2 at /dev/null and the log, takes the request's environment and
working directory, and runs `andrea/__main__.py` exactly as `python -m andrea` does (runpy), then leaves the
interpreter the ordinary way (atexit handlers, non-daemon threads joined, the exit status of sys.exit). The child is
a real process: SIGKILL and SIGTERM reach it by its pid. This process reaps its children and reports on stdout:
`spawned <id> <pid>` and `exit <pid> <returncode>` (negative: killed by that signal).

What differs from a fresh interpreter: modules are imported before the child's environment is set (andrea reads
its ANDREA_TEST_* variables when called, not at import, except the replica's backoff: andrea/testhooks.py), and
every child shares one PYTHONHASHSEED. Reads and writes only the logs it is asked for.
"""

from __future__ import annotations

import json
import os
import runpy
import select
import signal
import sys


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
                for pid in children:  # the campaign is gone: leave nothing behind
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
    log = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    sys.stdout.reconfigure(line_buffering=True)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = ["andrea", *req["argv"]]
    runpy.run_module("andrea", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    warm()
    import threading
    if threading.active_count() > 1:  # a fork copies one thread only: a lock another held stays held
        sys.stderr.write(f"campaign_zygote: {threading.active_count()} threads after the imports\n")
    sys.stdout.write("warm\n")
    sys.stdout.flush()
    request = serve()
    if request is not None:
        become(request)
