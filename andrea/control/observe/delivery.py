"""How one notice is delivered (control/observe/notify.py decides what and when): a command or an HTTP POST, each bounded
in total time and in the bytes it can make the trainer hold.

`run_command(argv, body, timeout_s)` starts the command in a session of its own (its own process group), writes
`body` to its stdin, keeps at most CAPTURE_BYTES of its stderr (the newest: the warning quotes its last line),
sends its stdout to /dev/null, and ends with SIGKILL to the whole group, once the command has exited or at the
deadline, whichever is first, before the command is reaped (the group's id stays reserved until then, so the
signal cannot reach an unrelated process). A hook therefore leaves nothing behind: `sh -c "sleep 1000"` ends
with its `sleep`, and a job it puts in the background ends when it exits (run a daemon elsewhere).

`post(url, body, timeout_s)` POSTs `body` with http.client and ONE deadline over the whole exchange: connecting,
sending, the reply's headers and at most REPLY_BYTES of its body. A socket timeout bounds each read only (a
server that trickles a byte a second would hold it for good), so the exchange runs on a thread of its own and
`post` waits for it until the deadline, no longer; then it shuts the exchange's socket down (which ends the
thread's read at once) and raises Expired. The socket is held from the moment it is connected: http.client
hands it to the reply and forgets it when the server says it will close the connection (HTTP/1.0, or
`Connection: close`), so a cut through the connection object would find nothing to shut. Nothing the server
does can make `post` return later than its deadline (a name lookup that hangs included: the thread is left to
it, and ends with it). An http_proxy/https_proxy/no_proxy environment is honoured as urllib does.

Both raise `Expired` past their deadline and OSError (http.client's errors included) otherwise; neither writes
anything. Plain functions, tested with real processes and a real loopback server (tests/unit/control/observe/).
"""

from __future__ import annotations

import http.client
import os
import selectors
import signal
import socket
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass

CAPTURE_BYTES = 4096  # of a command's stderr, the newest
REPLY_BYTES = 65536  # of a POST's reply body, read and discarded
POLL_S = 0.02  # how often a command's exit is looked for while its stderr is quiet


class Expired(TimeoutError):
    """The deadline passed before the command or the POST was done."""


@dataclass(frozen=True)
class Finished:
    returncode: int
    stderr_tail: bytes  # at most CAPTURE_BYTES, the newest


def run_command(argv: list[str], body: bytes, timeout_s: float) -> Finished:
    """Run `argv` with `body` on stdin (module docstring); Expired at the deadline, the whole group ended."""
    deadline = time.monotonic() + timeout_s
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    tail = b""
    try:
        with selectors.DefaultSelector() as sel:
            os.set_blocking(proc.stdin.fileno(), False)
            sel.register(proc.stdin, selectors.EVENT_WRITE)
            sel.register(proc.stderr, selectors.EVENT_READ)
            pending = memoryview(body)
            while not exited(proc):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Expired(f"took longer than {timeout_s:g} s")
                for key, _ in sel.select(min(left, POLL_S)):
                    if key.fileobj is proc.stdin:
                        try:
                            pending = pending[os.write(proc.stdin.fileno(), pending[:65536]):]
                        except BrokenPipeError:  # it does not read its stdin: its business
                            pending = pending[:0]
                        if not pending:
                            sel.unregister(proc.stdin)
                            proc.stdin.close()
                    else:
                        chunk = os.read(proc.stderr.fileno(), 65536)
                        if not chunk:
                            sel.unregister(proc.stderr)
                        tail = (tail + chunk)[-CAPTURE_BYTES:]
    finally:
        end_group(proc)
    if not proc.stderr.closed:  # what it wrote just before exiting (a descendant may hold the pipe: no wait)
        os.set_blocking(proc.stderr.fileno(), False)
        try:
            tail = (tail + (os.read(proc.stderr.fileno(), CAPTURE_BYTES) or b""))[-CAPTURE_BYTES:]
        except BlockingIOError:
            pass
        proc.stderr.close()
    return Finished(proc.returncode, tail)


def exited(proc: subprocess.Popen) -> bool:
    """Whether the command has exited, without reaping it where the OS allows (Linux: its process group id stays
    reserved until end_group); elsewhere (macOS has no waitid) it is reaped here."""
    if not hasattr(os, "waitid"):
        return proc.poll() is not None
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def end_group(proc: subprocess.Popen) -> None:
    """SIGKILL to the command's process group (it leads it: start_new_session), then reap the command."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if proc.stdin is not None and not proc.stdin.closed:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass


def post(url: str, body: bytes, timeout_s: float, headers: dict[str, str]) -> int:
    """POST `body` to `url` within `timeout_s` over the whole exchange (module docstring); the reply's status."""
    conn, path = connection(url, timeout_s)
    held: list[socket.socket] = []  # the exchange's socket, once connected: what the deadline shuts
    outcome: list = []  # the reply's status, or the exception that ended the exchange
    lock, done = threading.Lock(), threading.Event()

    def exchange() -> None:
        try:
            conn.connect()
            with lock:
                if done.is_set():  # the deadline passed while it connected
                    return
                held.append(conn.sock)
            conn.request("POST", path, body=body, headers=headers)
            reply = conn.getresponse()
            reply.read(REPLY_BYTES)
            outcome.append(reply.status)
        except BaseException as e:  # noqa: BLE001  (handed to the caller, which says what it was)
            outcome.append(e)
        finally:
            conn.close()
            done.set()

    threading.Thread(target=exchange, name="andrea-notify-post", daemon=True).start()
    finished = done.wait(timeout_s)
    with lock:
        if not finished and not outcome:
            done.set()
            for sock in held:
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # the thread's read or write fails at once
                except OSError:
                    pass
            raise Expired(f"took longer than {timeout_s:g} s")
    result = outcome[0]
    if isinstance(result, (OSError, http.client.HTTPException)):
        raise OSError(str(result) or type(result).__name__) from None
    if isinstance(result, BaseException):
        raise result
    return result


def connection(url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    """The connection for `url` (through the environment's proxy, if any, as urllib would) and the request
    target to send on it."""
    parts = urllib.parse.urlsplit(url)
    https = parts.scheme == "https"
    host, port = parts.hostname, parts.port or (443 if https else 80)
    path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
    kind = http.client.HTTPSConnection if https else http.client.HTTPConnection
    proxy = urllib.request.getproxies().get(parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
        p = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
        if https:  # a CONNECT tunnel through the proxy, TLS to the host
            conn = http.client.HTTPSConnection(p.hostname, p.port or 80, timeout=timeout_s)
            conn.set_tunnel(host, port)
            return conn, path
        return http.client.HTTPConnection(p.hostname, p.port or 80, timeout=timeout_s), url
    return kind(host, port, timeout=timeout_s), path
