"""The watchdog: a run that stops making progress ends with exit code 75 and its stacks in the log.

A run that hangs (a deadlocked collective, a driver stuck, a write that never returns) is a run that is lost until
someone looks; one that exits non-zero is restarted by its supervisor (systemd `Restart=on-failure`, a Kubernetes
Job, SLURM's requeue) and resumes from its newest checkpoint to the same bytes (docs/operating.md#the-watchdog-and-notices).

Three components are watched, each by plain counters its own thread bumps (`Beats`, one writer per counter):
    train     the training thread (`andrea-train`): a job (step, snapshot, eval, load) starting or returning, and
              each forward of an eval or a task audit inside one (`heartbeat`: an audit of 10,000 examples may
              take longer than floor_s, and is moving all along);
    io        the I/O thread (`andrea-io`): a job starting or returning, and on Linux every write or read call
              returning inside one (its /proc/self/task/<tid>/io counters: a checkpoint goes out in 64 MiB write
              calls, so a slow disk that keeps moving keeps reporting progress);
    boundary  the event loop while it crosses a step boundary or waits for a step: it waits on the other two,
              so it is moving whenever anything moves; it is hung only when nothing moves.
The decisions are `Tracker` and `limit`, plain code over those counters and the times of the polls (tested with
a fake clock, tests/unit/control/observe/test_watchdog.py). Time is counted as the watchdog's own polls see it, each poll
adding at most `max_tick`: after a `kill -STOP` and SIGCONT the monotonic clock has jumped, but the process was
not runnable, and the jump counts as one tick. `Watchdog` is the thin thread that polls; `end_hung_run` acts.

Writes, when it acts: one error line and every thread's stack (faulthandler) to stderr, the CUDA and process
group state when there is one; under torchrun a stall note to every other rank (control/parallel/stall_notes.py), so that
rank 0 writes the marker whichever rank hung and every rank ends now (`end_for_peer`: its own stacks, exit 75); a
`stall` marker in the ledger (rundir/ledger.py) through the I/O thread unless that thread is the one hung (waited
for at most MARKER_WAIT_S), a `stall` notice (control/observe/notify.py); then it ends the job's other ranks on this host
that are still there after the note's grace (the pids the ranks exchanged at start, `local_peers`): first SIGUSR2,
on which each rank's faulthandler writes its stacks (`arm_stack_dump`), then SIGKILL a second later (a rank that is
frozen — SIGSTOP, a driver — answers nothing else, and torchrun would wait 30 s for it before its own SIGKILL); and
the process exits with config.STALL_EXIT_CODE at once (os._exit: a hung thread cannot be joined). Ranks on other
hosts end on the note, by their own watchdog, or by their collectives' timeout.

Test hook (andrea/testhooks.py): `ANDREA_TEST_HANG=<train|io>@<step>[@<rank>]` hangs the training thread after the update that reaches
header step <step> (control/run/runtime.py), or the I/O thread at the start of the commit of step <step>
(control/commit/writer.py), once per process, on every rank or the one named. Never in production.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from andrea import testhooks
from andrea.config.keepers import STALL_EXIT_CODE, WatchdogConfig
from andrea.control.parallel.stall_notes import Note

log = logging.getLogger("andrea.watchdog")

COMPONENTS = ("train", "io", "boundary")  # the order a stall is named in: the most specific first
WHAT = {"train": "the training thread", "io": "the I/O thread", "boundary": "the step boundary (event loop)",
        "start": "the start (its data preparation on the training thread, or the event loop's thread)"}
MARKER_WAIT_S = 5.0  # how long the stall marker may wait for a live I/O thread (it may be mid-commit)
STACKS_SIGNAL = signal.SIGUSR2  # a rank's stacks to its stderr (arm_stack_dump); SIGUSR1 and SIGHUP are the run's
PEER_DUMP_S = 1.0  # how long a peer is given to write its stacks before it is ended


# --- the decisions -----------------------------------------------------------------------------------------------
def limit(floor: float, factor: float, slowest: float) -> float:
    """A component's limit: never under the floor, and `factor` times the longest wait without progress seen."""
    return max(floor, factor * slowest)


@dataclass(frozen=True)
class Stall:
    component: str
    seconds: float  # busy without progress, in runnable time
    limit: float


@dataclass
class Tracker:
    """Which components are hung, from successive polls of (busy, progress count) per component.

    `observe(now, snapshot)` adds the time since the previous poll, at most `max_tick`, to each component busy
    without progress since then; progress (a changed count) resets it and records the wait it ended in `slowest`
    (which raises that component's limit)."""

    floor: float
    factor: float
    max_tick: float
    last_poll: float | None = None
    counts: dict[str, int] = field(default_factory=dict)
    idle: dict[str, float] = field(default_factory=dict)
    slowest: dict[str, float] = field(default_factory=dict)

    def limit(self, component: str) -> float:
        return limit(self.floor, self.factor, self.slowest.get(component, 0.0))

    def observe(self, now: float, snapshot: dict[str, tuple[bool, int]]) -> list[Stall]:
        tick = 0.0 if self.last_poll is None else min(max(0.0, now - self.last_poll), self.max_tick)
        self.last_poll = now
        for c, (busy, count) in snapshot.items():
            moved = self.counts.get(c, count) != count
            self.counts[c] = count
            waited = self.idle.get(c, 0.0) + tick
            if moved:
                self.slowest[c] = max(self.slowest.get(c, 0.0), waited)
            self.idle[c] = waited if busy and not moved else 0.0
        return [Stall(c, self.idle[c], self.limit(c)) for c in COMPONENTS
                if c in snapshot and self.idle[c] > self.limit(c)]


# --- the counters the threads bump ---------------------------------------------------------------------------------
@dataclass
class Beat:
    busy: int = 0
    count: int = 0


class Beats:
    """Progress counters per component; each is written by its component's thread only (no lock needed)."""

    def __init__(self) -> None:
        self.parts = {c: Beat() for c in COMPONENTS}
        self.io_tid: int | None = None  # the I/O thread's kernel id: its /proc counters move inside one write

    def begin(self, c: str) -> None:
        b = self.parts[c]
        b.busy += 1
        b.count += 1

    def end(self, c: str) -> None:
        b = self.parts[c]
        b.busy -= 1
        b.count += 1

    async def watch(self, c: str, awaitable):
        """Await `awaitable` as component `c` (the boundary: the event loop crossing it or waiting for a step)."""
        self.begin(c)
        try:
            return await awaitable
        finally:
            self.end(c)

    def snapshot(self) -> dict[str, tuple[bool, int]]:
        io = self.parts["io"].count + syscalls(self.io_tid)
        train = self.parts["train"].count
        b = self.parts["boundary"]
        return {"train": (self.parts["train"].busy > 0, train), "io": (self.parts["io"].busy > 0, io),
                "boundary": (b.busy > 0, b.count + train + io)}  # it waits on the others: moving when they move


def syscalls(tid: int | None) -> int:
    """Read and write calls completed by thread `tid` (Linux /proc; 0 where there is none)."""
    if tid is None:
        return 0
    try:
        with open(f"/proc/self/task/{tid}/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["syscr"]) + int(fields["syscw"])
    except (OSError, KeyError, ValueError):
        return 0


_job = threading.local()  # the Beat of the component whose job this thread is running (WatchedExecutor)


def heartbeat() -> None:
    """Progress inside one long job (an eval's forward, a task audit's batch): on a watched thread it counts as
    its component's progress, as a job returning does; elsewhere it does nothing. Its thread alone writes it."""
    beat = getattr(_job, "beat", None)
    if beat is not None:
        beat.count += 1


class WatchedExecutor(ThreadPoolExecutor):
    """A one-thread executor whose jobs count as busy time and progress of component `name`; a job may report
    progress of its own with `heartbeat()`."""

    def __init__(self, beats: Beats, name: str, **kwargs):
        super().__init__(1, **kwargs)
        self.beats, self.name = beats, name

    def submit(self, fn, /, *args, **kwargs):
        return super().submit(self._run, fn, args, kwargs)

    def _run(self, fn, args, kwargs):
        if self.name == "io":
            self.beats.io_tid = threading.get_native_id()
        self.beats.begin(self.name)
        _job.beat = self.beats.parts[self.name]
        try:
            return fn(*args, **kwargs)
        finally:
            _job.beat = None
            self.beats.end(self.name)


# --- the thread that looks, and what it does ---------------------------------------------------------------------
class Watchdog:
    """Polls `beats` every cfg.poll seconds on a daemon thread; calls `on_stall(stall)` once, at the first."""

    def __init__(self, cfg: WatchdogConfig, beats: Beats, on_stall: Callable[[Stall], None],
                 clock: Callable[[], float] = time.monotonic):
        self.cfg, self.beats, self.on_stall, self.clock = cfg, beats, on_stall, clock
        # A tick longer than this is a process that was not runnable (SIGSTOP, a suspended VM): it counts this.
        self.tracker = Tracker(cfg.floor_s, cfg.factor, max_tick=max(3 * cfg.poll, 1.0))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="andrea-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        if self.cfg.enabled:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.poll):
            stalls = self.tracker.observe(self.clock(), self.beats.snapshot())
            if stalls and not self._stop.is_set():
                self.on_stall(stalls[0])
                return


def local_peers(ranks: list[tuple[str, int]], host: str, pid: int) -> list[int]:
    """The pids of the job's other ranks on this host, from every rank's (host, pid) in rank order."""
    return [p for h, p in ranks if h == host and p != pid]


def arm_stack_dump() -> None:
    """Every thread's stack to stderr on STACKS_SIGNAL (faulthandler, at the C level: it works while Python's
    threads are stuck): what a peer whose watchdog fired first asks of this rank before it ends it."""
    try:
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
    except (AttributeError, OSError, ValueError, io.UnsupportedOperation):  # no signals or no stderr descriptor
        pass


GONE, STOPPED = (None, "Z", "X"), ("T", "t")  # process states (/proc/<pid>/stat): ended; frozen (SIGSTOP)


def proc_state(pid: int) -> str | None:
    """`pid`'s state letter from Linux /proc; None: no such process. Without /proc, "?" for one that exists (it
    is treated as running: waited for, then signalled, as before the note)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return "?"


def end_peers(peers: list[int], grace: float = 0.0) -> None:
    """End the job's other ranks on this host. Those that can still end on their own (they do on the stall note,
    control/parallel/stall_notes.py) are given `grace` seconds; the rest are asked for their stacks (STACKS_SIGNAL,
    PEER_DUMP_S to write them: the rank that hung may be one of them, and its stacks are the diagnosis), then
    SIGKILLed (a frozen one answers nothing else). Gone ones are skipped."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(proc_state(p) not in GONE + STOPPED for p in peers):
        time.sleep(0.05)
    left = [p for p in peers if proc_state(p) not in GONE]
    if not left:
        return
    log.critical("watchdog: ending the job's other ranks on this host (pids %s) so that it ends now",
                 ", ".join(map(str, left)))
    for sig in (STACKS_SIGNAL, signal.SIGKILL):
        for pid in left:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == STACKS_SIGNAL:
            time.sleep(PEER_DUMP_S)


def _say_and_dump(message: str) -> None:
    """One critical line, then every thread's stack, to stderr (flushed: the process ends with os._exit)."""
    log.critical(message)
    for h in logging.getLogger().handlers:
        h.flush()
    err = sys.stderr if hasattr(sys.stderr, "fileno") else sys.__stderr__
    try:
        err.flush()
        faulthandler.dump_traceback(file=err, all_threads=True)
    except (OSError, ValueError, AttributeError):  # stderr without a file descriptor
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)


def _append(append_marker, io, line: dict) -> None:
    """The marker through the live I/O thread, waited for at most MARKER_WAIT_S."""
    try:
        io.submit(append_marker, line).result(timeout=MARKER_WAIT_S)
    except Exception as e:  # noqa: BLE001  (exiting anyway: the stacks are the record)
        log.error("watchdog: the stall marker was not written: %s", e or type(e).__name__)


def end_hung_run(note: Note, *, append_marker: Callable[[dict], None] | None, io, notify: Callable[..., None],
                 close_notices: Callable[[float], None], peers: list[int] = (),
                 post_note: Callable[[], bool] | None = None, grace: float = 0.0) -> None:
    """This rank's watchdog fired (`note`: what hung, after which step, on which rank): say so, dump every stack,
    tell the other ranks (`post_note`: whether the same note reached them, posted by the caller first), leave a
    `stall` marker and a notice, end the job's ranks on this host that the note has not ended within `grace`
    (`peers`), and exit STALL_EXIT_CODE."""
    from andrea.rundir.ledger import marker
    with _then_exit():
        _say_and_dump(f"watchdog: {WHAT[note.component]} made no progress for {note.seconds:.1f} s (limit "
                      f"{note.limit:.1f} s) after step {note.step}: writing every thread's stack and exiting "
                      f"{STALL_EXIT_CODE}, so that the supervisor restarts the run from its newest checkpoint")
        for line in device_state():
            log.critical("watchdog: %s", line)
        posted = post_note is not None and post_note()
        if append_marker is not None and note.component != "io":  # a hung I/O thread would never run the append
            _append(append_marker, io, marker("stall", note.step, **note.marker_detail()))
        notify("stall", note.step, message=f"{WHAT[note.component]} hung after step {note.step}; exiting "
               f"{STALL_EXIT_CODE}", **note.detail())
        close_notices(MARKER_WAIT_S)
        end_peers(list(peers), grace if posted else 0.0)


def end_for_peer(note: Note, step: int, *, append_marker: Callable[[dict], None] | None, io,
                 close_notices: Callable[[float], None]) -> None:
    """Another rank's watchdog is ending the job (its stall note, control/parallel/stall_notes.py): this rank's stacks
    (it may be the one that hung), the `stall` marker in the note's words on rank 0, and exit STALL_EXIT_CODE. The
    notice is the posting rank's to send."""
    from andrea.rundir.ledger import marker
    with _then_exit():
        _say_and_dump(f"watchdog: rank {note.rank} ({note.host}, pid {note.pid}) found {WHAT[note.component]} "
                      f"hung after step {note.step} ({note.seconds:.1f} s, limit {note.limit:.1f} s) and is ending "
                      f"the job: writing every thread's stack and exiting {STALL_EXIT_CODE}")
        if append_marker is not None:
            _append(append_marker, io, marker("stall", step, **note.marker_detail()))
        close_notices(MARKER_WAIT_S)


@contextlib.contextmanager
def _then_exit():
    """Whatever goes wrong on the way out, the process ends with STALL_EXIT_CODE: a hung run that its watchdog
    failed to end would wait for good."""
    try:
        yield
    except BaseException:
        log.exception("watchdog: ending the hung run met an error; exiting %d all the same", STALL_EXIT_CODE)
    finally:
        try:
            logging.shutdown()
        finally:
            os._exit(STALL_EXIT_CODE)


def device_state() -> list[str]:
    """What is cheap to read about CUDA and the process group when the run hangs (never a call that may block)."""
    lines = []
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        d = torch.cuda.current_device()
        lines.append(f"cuda device {d} ({torch.cuda.get_device_name(d)}): {torch.cuda.memory_allocated(d)} bytes "
                     f"allocated, {torch.cuda.memory_reserved(d)} reserved")
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        lines.append(f"process group: {dist.get_backend()} rank {dist.get_rank()} of {dist.get_world_size()}")
    nccl = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL_"))}
    if nccl:
        lines.append("nccl environment: " + " ".join(f"{k}={v}" for k, v in sorted(nccl.items())))
    return lines


# --- the test hook -----------------------------------------------------------------------------------------------
_hung: set[str] = set()


def test_hang(where: str, step: int, rank: int = 0) -> None:
    """ANDREA_TEST_HANG=<where>@<step>[@<rank>]: block this thread for good, once per process. Never in production."""
    spec = testhooks.hang()  # andrea/testhooks.py
    if not spec or where in _hung:
        return
    parts = spec.split("@")
    if parts[0] == where and parts[1:2] == [str(step)] and (len(parts) < 3 or parts[2] == str(rank)):
        _hung.add(where)
        log.warning("test hook ANDREA_TEST_HANG=%s: %s hangs now", spec, WHAT[where])
        threading.Event().wait()
