"""The ledger's feed and its markers from other threads (control/run/ledger_feed.py), wired at construction: a real
`.loss.json` (rundir/ledger.py), a real event loop and real threads; no process.

The feed is built with everything it tells (`on_flush`: the views and the notices) and the lines recorded before
it existed (the start's markers); the route of a marker put by another thread (the replicator's outage and
catch-up) follows the end of the process: through the event loop, then appended by the putting thread while the
stop waits for the replica, then only a log line once the ledger is closed.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

from andrea.control.parallel.distributed import World
from andrea.control.run.ledger_feed import LedgerFeed, ThreadMarkers, open_ledger
from andrea.rundir.ledger import LossLedger, marker, read_ledger
from andrea.rundir.names import LEDGER_NAME


def test_the_lines_a_feed_is_built_with_reach_its_on_flush_and_the_file_at_its_first_flush(tmp_path):
    ledger = LossLedger(tmp_path / LEDGER_NAME)
    seen: list[dict] = []
    with ThreadPoolExecutor(1) as io:
        feed = LedgerFeed(ledger, io, lines=[marker("start", 0, run="r1")], on_flush=seen.extend)
        feed.lines.append({"step": 1, "loss": 2.5})
        feed.flush(force_sync=True)
        feed.wait()
    ledger.close()
    assert [line.get("event", "step") for line in seen] == ["start", "step"]  # told, in ledger order
    assert [e.get("event", "step") for e in read_ledger(tmp_path / LEDGER_NAME).entries] == ["start", "step"]


def test_a_marker_from_a_thread_goes_through_the_loop_then_directly_then_only_to_the_log(tmp_path, caplog):
    held = ExitStack()
    ledger, ends, lines = open_ledger(tmp_path, None, held, world=World(), accept_gap=False, skipped=[])
    assert lines == []  # a start from nothing: no incident of a resume
    shown: list[tuple[str, int, threading.Thread]] = []
    at = {"step": 7}

    def on_flush(batch):
        shown.extend((line.get("event", "step"), line["step"], threading.current_thread()) for line in batch)

    io = ThreadPoolExecutor(1)
    feed = LedgerFeed(ledger, io, on_flush=on_flush)

    async def life() -> None:
        loop = asyncio.get_running_loop()
        put = ends.to_ledger(loop, feed, lambda: at["step"])
        await loop.run_in_executor(None, put, "replica_down", {"uri": "s3://b/r", "error": "refused"})
        # put queued it on the loop before it returned, ahead of the executor's own completion: it has run
        assert shown and shown[-1][:2] == ("replica_down", 7) and shown[-1][2] is threading.main_thread()
        feed.wait()
        io.shutdown(wait=True)  # the I/O thread is done, as at the stop
        ends.direct()
        at["step"] = 9
        await loop.run_in_executor(None, put, "replica_back", {"uri": "s3://b/r", "down_s": 3, "replica_step": 9})
        assert shown[-1][:2] == ("replica_back", 9) and shown[-1][2] is not threading.main_thread()
        held.close()  # the ledger's release: closed
        with caplog.at_level(logging.INFO, logger="andrea.control.run"):
            await loop.run_in_executor(None, put, "replica_down", {"uri": "s3://b/r", "error": "late"})
    asyncio.run(life())
    entries = read_ledger(tmp_path / LEDGER_NAME).entries
    assert [(e["event"], e["step"]) for e in entries] == [("replica_down", 7), ("replica_back", 9)]
    assert "replica_down after the run's end: not in the ledger" in caplog.text
    assert len(shown) == 2  # the late one told no one either


def test_a_ledger_rank_0_refuses_is_refused_on_every_rank_in_its_one_line(tmp_path):
    """Campaign seed 483 (two ranks: a flipped bit in `.loss.json` inside the history step 12 vouches for): rank 0
    alone checks the ledger and refused the start in its one line, while rank 1 went on into the step loop, whose
    first collective rank 0's exit broke into a traceback. The refusal is now every rank's one line, and the file
    is left as it was found."""
    from andrea.rundir.ledger import LedgerError
    from tests.sharding import run_ranks
    from tests.unit.control.run.test_resume_ledger import run_with_checkpoint
    path, info = run_with_checkpoint(tmp_path)
    data = bytearray(path.read_bytes())
    data[data.index(b'"loss":1.0') + 9] ^= 1  # 1.0 -> 1.1 in the vouched history: valid JSON, a plausible loss
    path.write_bytes(data)

    def rank(world):
        with ExitStack() as held:
            return open_ledger(tmp_path, info, held, world=world, accept_gap=False, skipped=[])
    got = run_ranks(2, rank)
    assert all(isinstance(got[r], LedgerError) for r in (0, 1)), got
    assert str(got[0]) == str(got[1]) and "changed inside the history" in str(got[1])
    assert path.read_bytes() == data
