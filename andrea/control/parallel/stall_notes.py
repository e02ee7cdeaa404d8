"""Stall notes: the rank whose watchdog ends a torchrun job tells every other rank why, through the job's store.

Under torchrun the ledger is rank 0's. A hung rank r > 0 used to end rank 0 (SIGKILL, control/observe/watchdog.py) before
rank 0's own watchdog had seen anything, since rank 0 only starts waiting a step later: the job went down with the
hung rank's notice but no `stall` marker. Now the rank whose watchdog fires first posts a note, and every other
rank's listener reads it within POLL_S: rank 0 writes the `stall` marker in the note's words (which rank, which
component, how long, its limit), every rank writes its own stacks to its log and exits 75
(control/observe/watchdog.py::end_for_peer), and the job ends together on every host, without waiting for a collective's
timeout. The rank that posted ends the ranks on its host that are still there after PEER_GRACE_S. Its end may
reach a rank on another host first, as a collective that fails (the peer closed its connection) before the
listener's next poll: that rank reads the note then (`read`: it was posted before the posting rank ended) and
ends on it all the same (control/run/stalls.py), instead of failing with exit 1 and no marker.

The channel is the job's c10d store (the TCPStore at MASTER_ADDR:MASTER_PORT that torchrun serves for the
rendezvous): the hang that fired the watchdog may be inside a collective of any process group, and the store
belongs to none of them. Each rank opens a client of its own with a short timeout (STORE_TIMEOUT_S), and only the
listener's thread and a bounded post ever wait on it: a store that stops answering never holds up a watchdog.

Reads and writes one key, `andrea/stall/<TORCHELASTIC_RESTART_COUNT>` (a worker group that torchrun restarts gets
a fresh key), set once: the first rank to post wins (compare_set), and later notes of the same hang are dropped.
A rank whose watchdog fires after another rank's note is in the store (a peer waiting in a collective on the hung
rank fires a little later: its clock started when it began to wait, after the hung rank's last progress) learns
so from compare_set's answer and ends on that note (`winner`) instead of its own: one `stall` marker naming the
rank that hung, one notice (the posting rank's), however close together the watchdogs fire. A rank whose stall is
in the step boundary (`boundary`: it waits in a collective on its peers) may fire first all the same: its clock
started when it began to wait, which can be before the hung rank's last progress. So such a rank is a witness, not
a suspect: before it posts, it gives a rank stalled in its own work (`train`, `io`) WITNESS_GRACE_S to post first
(`defer`), and ends on that note when one comes.
Its value is JSON: {"rank": r, "pid": p, "host": "gpu7", "step": S, "component": "train" | "io" | "boundary",
"seconds": 12.3, "limit": 10.0}.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any

log = logging.getLogger("andrea.control.parallel.stall_notes")

POLL_S = 0.25  # how often a listener looks: one store round trip (~0.1 ms on one host)
STORE_TIMEOUT_S = 5.0  # the longest a store call may wait
PEER_GRACE_S = 6.0  # how long the posting rank waits for its host's other ranks to end on the note, then ends them
KEY_PREFIX = "andrea/stall/"
WITNESS_GRACE_S = 3.0  # how long a rank waiting on its peers lets a rank stalled in its own work post first: the
                       # hung rank's watchdog fires within about a step of the waiting one's (tiny steps to seconds)


@dataclass(frozen=True)
class Note:
    rank: int
    pid: int
    host: str
    step: int
    component: str
    seconds: float
    limit: float

    def detail(self) -> dict[str, Any]:
        """What hung and for how long: the `stall` notice's fields beyond its step (the notice names its own rank,
        control/observe/notify.py)."""
        return {"component": self.component, "seconds": round(self.seconds, 1), "limit": round(self.limit, 1)}

    def marker_detail(self) -> dict[str, Any]:
        """The `stall` marker's fields beyond its step (rundir/ledger.py): `detail` and the rank that hung."""
        return {**self.detail(), "rank": self.rank}


def key(env: Mapping[str, str] = os.environ) -> str:
    """The note's key for this worker group: torchrun restarts a failed group in place (--max-restarts) with the
    same store, and a note of the last attempt must not end the next one."""
    return KEY_PREFIX + env.get("TORCHELASTIC_RESTART_COUNT", "0")


def encode(note: Note) -> str:
    return json.dumps(asdict(note), sort_keys=True)


def decode(raw: bytes | str) -> Note | None:
    """The note in `raw`, or None when it is not one (a store shared with something else)."""
    try:
        return Note(**json.loads(raw))
    except (ValueError, TypeError):
        return None


def heard(raw: bytes | str | None, rank: int) -> Note | None:
    """What a listener on `rank` acts on: another rank's note (its own is what it already acts on)."""
    note = decode(raw) if raw is not None else None
    return note if note is not None and note.rank != rank else None


def winner(mine: Note, stored: bytes | str | None) -> Note:
    """The note the job ends on, after this rank offered `mine` and the store answered `stored` (compare_set's
    reply: the value now at the key; None or junk: no answer worth trusting). The first note posted wins: a note
    of another rank already there means that rank hung first; otherwise `mine` was taken."""
    other = decode(stored) if stored else None
    return other if other is not None else mine


def defer(mine: Note) -> bool:
    """Whether `mine` waits WITNESS_GRACE_S for another rank's note before it is posted: a stall in the step boundary
    is a rank waiting in a collective on the others, the witness of a hang elsewhere more often than its cause."""
    return mine.component == "boundary"


def open_store(env: Mapping[str, str] = os.environ):
    """A client of the job's store (None: not under a launcher that serves one, or unreachable: no notes)."""
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    if not addr or not port:
        return None
    import torch.distributed as dist
    try:
        return dist.TCPStore(addr, int(port), is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=STORE_TIMEOUT_S))
    except (RuntimeError, ValueError) as e:  # DistNetworkError is a RuntimeError
        log.warning("the job's store at %s:%s is not reachable (%s): a rank that hangs ends its host's ranks, "
                    "the ledger may lack its stall marker", addr, port, e)
        return None


def bounded(fn: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
    """(finished, result or exception) of fn run on a daemon thread for at most `timeout` seconds: a store call
    from a watchdog that is about to exit must not become a second hang."""
    out: list = []

    def run() -> None:
        try:
            out.append(fn())
        except Exception as e:  # noqa: BLE001  (handed to the caller)
            out.append(e)
    t = threading.Thread(target=run, name="andrea-stall-post", daemon=True)
    t.start()
    t.join(timeout)
    return (bool(out), out[0] if out else None)


class Notes:
    """This rank's end of the channel: `post` a note when its watchdog fires; a listener thread calls
    `on_note(note)` once, at the first note of another rank."""

    def __init__(self, store, rank: int, on_note: Callable[[Note], None], env: Mapping[str, str] = os.environ,
                 poll: float = POLL_S):
        self.store, self.rank, self.on_note, self.poll = store, rank, on_note, poll
        self.key = key(env)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="andrea-stall-notes", daemon=True)

    def start(self) -> "Notes":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def post(self, note: Note, grace: float = WITNESS_GRACE_S) -> Note | None:
        """Post `note` unless another rank's is there already: the note the job ends on (`winner`: `note`, or the
        other rank's that was first); None when the store did not answer in time (then `note` is this rank's). A
        witness (`defer`) first waits up to `grace` for another rank's note, and ends on it without posting."""
        if defer(note):
            deadline = time.monotonic() + grace
            while True:
                other = self.read()
                if other is not None or time.monotonic() >= deadline:
                    break
                time.sleep(min(self.poll, max(0.0, deadline - time.monotonic())))
            if other is not None:
                return other
        done, result = bounded(lambda: self.store.compare_set(self.key, "", encode(note)), STORE_TIMEOUT_S)
        if not done or isinstance(result, Exception):
            log.error("the stall note did not reach the job's store (%s): the other ranks end by their own "
                      "watchdogs", result if done else f"no answer in {STORE_TIMEOUT_S:.0f} s")
            return None
        return winner(note, result)

    def _raw(self) -> bytes | None:
        return self.store.get(self.key) if self.store.check([self.key]) else None

    def read(self) -> Note | None:
        """Another rank's note, read now (bounded): what a rank whose collective just failed asks first. The
        posting rank posts before it ends, so when its end is what failed the collective, its note is there."""
        done, result = bounded(self._raw, STORE_TIMEOUT_S)
        return heard(result, self.rank) if done and not isinstance(result, Exception) else None

    def _listen(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                raw = self._raw()
            except RuntimeError as e:  # the store is gone (the launcher ended): nothing more will come
                if not self._stop.is_set():
                    log.warning("the job's store stopped answering (%s): no stall notes from other ranks", e)
                return
            note = heard(raw, self.rank)
            if note is not None and not self._stop.is_set():
                self.on_note(note)
                return


def listen(rank: int, on_note: Callable[[Note], None], env: Mapping[str, str] = os.environ) -> Notes | None:
    """This rank's notes, listening (None where there is no store to reach: the hung rank's own watchdog and the
    collectives' timeout still end the job)."""
    store = open_store(env)
    return Notes(store, rank, on_note, env).start() if store is not None else None
