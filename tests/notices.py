"""A loopback HTTP server that collects the notices a trainer POSTs (control/observe/notify.py), for end-to-end tests.

stdlib `http.server` on 127.0.0.1, port 0 (the kernel picks a free one), served on a daemon thread; `events`
is every JSON body received, in arrival order. `Inbox(trickle_s=0.2)` is a hostile server: it records the body,
then answers one byte of a header line every `trickle_s` seconds, for as long as the client listens (each read
is quick, so only a deadline over the whole exchange ends it); `hung` counts the replies being trickled.
`Inbox(drip_s=1.0)` answers `HTTP/1.0 200` with `Content-Length: 60` at once, then the body one byte every `drip_s`
seconds (the client owns a reply on a connection the server closes: http.client hands it the socket);
`Inbox(silent=True)` records the body and never answers, until closed.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Inbox:
    def __init__(self, trickle_s: float | None = None, drip_s: float | None = None, silent: bool = False) -> None:
        self.events: list[dict] = []
        self.hung = 0
        self._cond = threading.Condition()
        self._closed = threading.Event()
        inbox = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with inbox._cond:
                    inbox.events.append(json.loads(body))
                    inbox._cond.notify_all()
                if trickle_s is not None:
                    self.trickle(trickle_s)
                    return
                if drip_s is not None:
                    self.drip(drip_s)
                    return
                if silent:
                    self.hold()
                    return
                self.send_response(204)
                self.end_headers()

            def trickle(self, every: float) -> None:
                self.wfile.write(b"HTTP/1.1 200 OK\r\nX-Trickle: ")
                self.hold(lambda: self.wfile.write(b"z") or self.wfile.flush(), every)

            def drip(self, every: float) -> None:
                self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Length: 60\r\n\r\n")
                self.wfile.flush()
                self.hold(lambda: self.wfile.write(b"z") or self.wfile.flush(), every)

            def hold(self, each=None, every: float = 0.05) -> None:
                """Until the client gives up or the inbox closes: `each()` every `every` seconds (None: silence)."""
                with inbox._cond:
                    inbox.hung += 1
                try:
                    while not inbox._closed.wait(every):
                        if each is not None:
                            each()
                except OSError:  # the client gave up: what a deadline is for
                    pass
                finally:
                    with inbox._cond:
                        inbox.hung -= 1
                        inbox._cond.notify_all()
                    self.close_connection = True

            def log_message(self, *args) -> None:  # quiet: the test asserts on what arrived
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def kinds(self) -> list[str]:
        return [e["event"] for e in self.events]

    def wait_for(self, kind: str, timeout: float = 30.0) -> dict:
        """The first event of `kind` received (now or within `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [e for e in self.events if e["event"] == kind]
                if found:
                    return found[0]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"no {kind!r} notice within {timeout}s; received {self.kinds()}")
                self._cond.wait(remaining)

    def wait_until(self, done, timeout: float = 30.0) -> None:
        """Wait until `done(self)` holds (checked at each received body and each trickle that ends)."""
        with self._cond:
            if not self._cond.wait_for(lambda: done(self), timeout):
                raise TimeoutError(f"not within {timeout}s; received {self.kinds()}, {self.hung} replies trickling")

    def close(self) -> None:
        self._closed.set()
        self.server.shutdown()
        self.server.server_close()
