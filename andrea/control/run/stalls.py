"""How a training process ends on a stall: its own watchdog's, another rank's, or a failure that a stall explains.

The wiring between the watchdog (control/observe/watchdog.py: what hung, and `end_hung_run` / `end_for_peer`, which act
and exit 75) and the stall notes (control/parallel/stall_notes.py: the channel between ranks). Exactly one thread ends the
process (`_ending`): the watchdog's on this rank's own stall (`on_stall`), the notes' listener on another rank's
(`on_peer_stall`), or the event loop on a failure that a stall explains (`explain`): a collective whose peer on
another host has just ended on its watchdog, its note posted before it ended. A watchdog that fires after
another rank's note was posted (before the listener polled) ends on that note, as the listener would have
(`stall_notes.winner`): the rank named is the rank that hung, once. Rank 0 writes the `stall` marker
whichever rank hung (`append_marker`, through the I/O thread); the notices go out through the notifier.

Reads the job's store (torchrun's, for the notes) and the ranks' (host, pid) at `join`; writes nothing itself.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

from andrea.control.observe import notify, watchdog
from andrea.control.parallel import stall_notes
from andrea.control.parallel.distributed import World


class Stalls:
    """This process's end on a stall, for a run at `step()` whose ledger markers go through `append_marker` (rank
    0's; the other ranks write none)."""

    def __init__(self, world: World, io, notifier: notify.Notifier, step: Callable[[], int],
                 append_marker: Callable[[dict], None]):
        self.world, self.io, self.notifier, self.step = world, io, notifier, step
        self.append_marker = append_marker if world.leader else None
        self.peers: list[int] = []  # the pids of the job's other ranks on this host (torchrun)
        self.notes: stall_notes.Notes | None = None  # torchrun: the stall notes of a hung rank's watchdog
        self._ending = threading.Lock()  # held by the one thread that ends a hung run

    def join(self) -> None:
        """With every rank (a collective), before the step loop: the ranks on this host, which a hung rank's
        watchdog ends, and under torchrun a listener for the other ranks' notes."""
        host, pid = socket.gethostname(), os.getpid()
        self.peers = watchdog.local_peers(self.world.gather((host, pid)), host, pid)
        if self.peers:
            watchdog.arm_stack_dump()  # a peer's watchdog asks for this rank's stacks before it ends it
        if self.world.distributed:
            self.notes = stall_notes.listen(self.world.rank, self.on_peer_stall)

    def stop(self) -> None:
        if self.notes is not None:
            self.notes.stop()

    def on_stall(self, stall: watchdog.Stall) -> None:
        """On the watchdog's thread: the run is hung; say so, tell the other ranks, leave a marker and a notice,
        end the job's other ranks on this host, exit 75."""
        if not self._ending.acquire(blocking=False):  # a peer's note is ending this rank already
            return
        note = stall_notes.Note(self.world.rank, os.getpid(), socket.gethostname(), self.step(), stall.component,
                                stall.seconds, stall.limit)
        won = self.notes.post(note) if self.notes is not None else None  # bounded (stall_notes.STORE_TIMEOUT_S)
        if won is not None and won.rank != note.rank:  # another rank hung first, and this one waited on it
            watchdog.end_for_peer(won, self.step(), io=self.io, close_notices=self.notifier.close,
                                  append_marker=self.append_marker)
            return
        watchdog.end_hung_run(note, io=self.io, append_marker=self.append_marker, notify=self.notifier.send,
                              close_notices=self.notifier.close, peers=self.peers,
                              post_note=(lambda: won is not None) if self.notes else None,
                              grace=stall_notes.PEER_GRACE_S)

    def on_peer_stall(self, note: stall_notes.Note) -> None:
        """On the notes' thread: another rank's watchdog is ending the job; rank 0 records it, every rank ends."""
        if self._ending.acquire(blocking=False):
            watchdog.end_for_peer(note, self.step(), io=self.io, close_notices=self.notifier.close,
                                  append_marker=self.append_marker)

    def explain(self) -> None:
        """On a failure: when a stall explains it (a peer's note, or a thread of this process already ending it),
        the stall ends the run (exit 75, the marker on rank 0), not the error. Returns when none does."""
        note = self.notes.read() if self.notes is not None and not self._ending.locked() else None
        if note is not None:
            self.on_peer_stall(note)  # exits, unless the listener took the note a moment before
        if self._ending.locked():
            self._ending.acquire()  # the thread that holds it exits the process: never returns
