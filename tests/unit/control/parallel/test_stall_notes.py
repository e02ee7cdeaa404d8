"""Stall notes (control/parallel/stall_notes.py): the decisions over plain data, then the channel over a real c10d
TCPStore served in this process (the server torchrun runs for a job), with the listener's real thread."""

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from andrea.control.parallel import stall_notes
from andrea.control.parallel.stall_notes import Note, Notes, decode, encode, heard, key, winner


def note(rank=1, **kw) -> Note:
    fields = dict(rank=rank, pid=4242, host="gpu7", step=15, component="train", seconds=12.34, limit=10.0) | kw
    return Note(**fields)


def test_a_note_reads_back_as_written_and_anything_else_is_no_note():
    n = note()
    assert decode(encode(n)) == n and decode(encode(n).encode()) == n
    assert decode(b"not json") is None and decode(b'{"rank": 1}') is None and decode(b"[1, 2]") is None


def test_a_listener_hears_the_other_ranks_notes_never_its_own():
    raw = encode(note(rank=1))
    assert heard(raw, 0) == note(rank=1) and heard(raw, 2) == note(rank=1)
    assert heard(raw, 1) is None and heard(None, 0) is None and heard(b"junk", 0) is None


def test_when_two_watchdogs_fire_the_note_posted_first_names_the_rank_the_job_ends_on():
    """Issue 55: rank 1 hung, its watchdog posted; rank 0's fired 47 ms later, before its listener polled, and
    wrote its own rank on the marker. The store's answer to rank 0's post is rank 1's note: that one wins."""
    mine, theirs = note(rank=0, component="boundary", seconds=10.05), note(rank=1, seconds=10.1)
    assert winner(mine, encode(theirs)) == theirs and winner(mine, encode(theirs).encode()) == theirs
    assert winner(theirs, encode(theirs)) == theirs  # compare_set took it: the answer is the note itself
    assert winner(mine, None) == mine and winner(mine, b"") == mine and winner(mine, b"junk") == mine


def test_the_second_rank_to_post_is_told_the_first_ranks_note(server):
    store = stall_notes.open_store(server)
    hung, waiting = Notes(store, 1, print, server), Notes(store, 0, print, server)
    assert hung.post(note(rank=1)) == note(rank=1)
    assert waiting.post(note(rank=0, component="boundary")) == note(rank=1)


def test_a_rank_waiting_on_its_peers_lets_the_hung_rank_post_first(server):
    """Issue 55: rank 0, waiting in the boundary's collective before rank 1 hung in its step, fired first and its
    note named rank 0. A witness now waits for a note of a rank stalled in its own work and ends on that one; the
    store holds the hung rank's note, so every rank's listener and rank 0's marker name rank 1."""
    store = stall_notes.open_store(server)
    hung, waiting = Notes(store, 1, print, server), Notes(store, 0, print, server)
    late = threading.Timer(0.5, hung.post, args=(note(rank=1),))
    late.start()
    try:
        assert waiting.post(note(rank=0, component="boundary"), grace=10.0) == note(rank=1)
    finally:
        late.join()
    assert decode(store.get(key(server))) == note(rank=1)


def test_a_witness_with_no_other_note_posts_its_own_after_the_grace(server):
    store = stall_notes.open_store(server)
    waiting = Notes(store, 0, print, server)
    assert stall_notes.defer(note(component="boundary")) and not stall_notes.defer(note(component="train"))
    assert waiting.post(note(rank=0, component="boundary"), grace=0.3) == note(rank=0, component="boundary")
    assert decode(store.get(key(server))) == note(rank=0, component="boundary")


def test_the_marker_names_the_rank_that_hung_and_its_wait():
    assert note(rank=3).marker_detail() == {"component": "train", "seconds": 12.3, "limit": 10.0, "rank": 3}


def test_a_worker_group_torchrun_restarts_listens_on_a_key_of_its_own():
    assert key({}) == key({"TORCHELASTIC_RESTART_COUNT": "0"})
    assert key({"TORCHELASTIC_RESTART_COUNT": "1"}) != key({"TORCHELASTIC_RESTART_COUNT": "0"})


def test_a_call_that_never_returns_is_given_up_on():
    never = threading.Event()
    done, result = stall_notes.bounded(never.wait, 0.2)
    assert not done and result is None
    assert stall_notes.bounded(lambda: 7, 5.0) == (True, 7)
    done, result = stall_notes.bounded(lambda: 1 / 0, 5.0)
    assert done and isinstance(result, ZeroDivisionError)


def test_no_launcher_no_store_no_notes():
    assert stall_notes.open_store({}) is None and stall_notes.listen(0, print, {}) is None


# --- over a real store --------------------------------------------------------------------------------------------
@pytest.fixture
def server():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    yield {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(s.port)}
    del s


class Heard:
    def __init__(self):
        self.notes: list[Note] = []
        self.event = threading.Event()

    def __call__(self, n: Note) -> None:
        self.notes.append(n)
        self.event.set()


def test_rank_1s_note_reaches_rank_0s_listener_once(server):
    heard0, heard1 = Heard(), Heard()
    r0 = stall_notes.listen(0, heard0, server)
    r1 = stall_notes.listen(1, heard1, server)
    try:
        assert r1.post(note(rank=1))
        assert heard0.event.wait(10), "rank 0 never heard rank 1's note"
        assert heard0.notes == [note(rank=1)]
        assert not heard1.event.wait(3 * stall_notes.POLL_S)  # the poster's own listener had its chances
    finally:
        r0.stop(), r1.stop()


def test_the_first_note_of_a_hang_is_the_one_every_rank_reads(server):
    store = stall_notes.open_store(server)
    a, b = Notes(store, 1, print, server), Notes(store, 2, print, server)
    assert a.post(note(rank=1, component="train")) and b.post(note(rank=2, component="io"))
    assert decode(store.get(a.key)) == note(rank=1, component="train")


def test_an_earlier_attempts_note_ends_no_rank_of_the_next(server):
    first = Notes(stall_notes.open_store(server), 1, print, server)
    assert first.post(note(rank=1))
    later = {**server, "TORCHELASTIC_RESTART_COUNT": "1"}
    heard0 = Heard()
    listener = stall_notes.listen(0, heard0, later)
    try:
        assert not heard0.event.wait(5 * stall_notes.POLL_S)
        assert Notes(stall_notes.open_store(later), 2, print, later).post(note(rank=2))
        assert heard0.event.wait(10) and heard0.notes == [note(rank=2)]
    finally:
        listener.stop()


def test_a_rank_whose_collective_failed_reads_the_note_at_once(server):
    """The read a failed collective makes (control/run/runtime.py): another rank's note, now, without the listener; none
    before a note, and never this rank's own."""
    store = stall_notes.open_store(server)
    rank0, rank1 = Notes(store, 0, print, server), Notes(store, 1, print, server)
    assert rank0.read() is None  # nothing posted: the failure is the error's own
    assert rank1.post(note(rank=1))
    assert rank0.read() == note(rank=1) and rank1.read() is None


def test_a_read_from_a_store_that_is_gone_is_no_note():
    """The launcher's store ended (the launcher with it): the failed collective is the error's own."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master.port)}
    notes = Notes(stall_notes.open_store(env), 0, print, env)
    assert Notes(stall_notes.open_store(env), 1, print, env).post(note(rank=1)) and notes.read() == note(rank=1)
    del master
    assert notes.read() is None
