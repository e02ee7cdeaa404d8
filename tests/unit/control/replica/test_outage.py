"""A replica outage on the record (control/replica/plan.py `open_outage`, `Health.inherit`) and what a stop says
of its replica (`stop_line`): a process that ends with its replica down leaves the outage open, and the next
process that reaches the store closes it; one line at the stop, true whichever way the wait ended. Plain ledger
entries and an injected clock, no store, no processes."""

from __future__ import annotations

import pytest

from andrea.control.replica.plan import Health, open_outage, stop_line
from andrea.control.replica.remote import ReplicaError
from andrea.rundir.ledger import marker

URI = "s3://b/run"


def down(step: int, t: float, problem: str = "unreachable", uri: str = URI) -> dict:
    return {**marker("replica_down", step, uri=uri, problem=problem, error=f"replica {uri}: {problem}"), "time": t}


def back(step: int, t: float, uri: str = URI) -> dict:
    return {**marker("replica_back", step, uri=uri, down_s=1.0, replica_step=step), "time": t}


def test_an_outage_a_process_ended_with_is_open_on_the_record_until_a_replica_back():
    steps = [{"step": s, "loss": 1.0, "time": 1.0} for s in range(1, 4)]
    assert open_outage(steps, URI) == []
    assert open_outage([*steps, down(17, 50.0)], URI) == [down(17, 50.0)]  # seed 20: the process ended so
    assert open_outage([down(17, 50.0), back(20, 60.0)], URI) == []
    later = [down(17, 50.0), back(20, 60.0), down(30, 70.0), down(31, 71.0, "full")]  # the problem changed
    assert open_outage(later, URI) == [down(30, 70.0), down(31, 71.0, "full")]


def test_an_outage_stays_open_across_a_resume_below_it_and_belongs_to_its_replica_only():
    resumed = [down(22, 50.0), {**marker("resume", 16, **{"from": "step_000016.bin"}), "time": 55.0}]
    assert open_outage(resumed, URI) == [down(22, 50.0)]  # the run went back, not the store
    assert open_outage([down(22, 50.0, uri="s3://b/old")], URI) == []  # another replica's outage
    assert open_outage([down(22, 50.0), back(23, 60.0, uri="s3://b/old")], URI) == [down(22, 50.0)]


def test_a_process_that_inherits_an_open_outage_says_it_back_once_and_no_second_down():
    h = Health(base=1.0, cap=60.0)
    h.inherit([down(17, 1000.0), down(18, 1001.0, "full")], now=5.0, wall=1030.0)
    assert h.error and h.due(5.0)  # status shows the error until a pass; the first pass is not delayed
    assert h.outage_s(5.0) == pytest.approx(30.0)  # since the outage's first marker, in wall seconds
    full = ReplicaError("replica x: full", "full")
    assert "replica x: full" in h.failed(full, 6.0)  # said in this process's log ...
    assert not h.record("full")  # ... but the record already has its replica_down
    assert h.failed(full, 7.0) is None  # then said no more
    assert h.record("unreachable")  # another problem: a marker of its own
    assert h.succeeded() == "replica reachable again: caught up"  # the replica_back that closes it
    assert h.record("full")  # an outage after it: on the record again
    fresh = Health()
    fresh.inherit([], now=5.0, wall=1030.0)
    assert fresh.succeeded() is None and fresh.error is None  # no outage on the record: nothing to close


def test_what_a_stop_says_of_its_replica_is_one_true_line():
    assert "holds step 24, the newest checkpoint" in stop_line(URI, True, 24, 24, 0.3, False)
    current = stop_line(URI, False, 24, 24, 2.0, True)  # the ledger's tail and files are what is missing
    assert "holds the newest checkpoint (step 24) but not" in current and "behind" not in current
    assert "still failing after a 2 s wait" in current and "sends them" in current
    behind = stop_line(URI, False, 8, 24, 2.0, False)
    assert "behind" in behind and "holds step 8" in behind and "step 24" in behind and "2 s wait" in behind
    assert "up to date" not in behind and "failing" not in behind
    assert "holds no checkpoint, the newest checkpoint is step 8" in stop_line(URI, False, None, 8, 2.0, True)
    for line in (current, behind, stop_line(URI, True, None, None, 0.1, False)):
        assert "\n" not in line and URI in line and "None" not in line
