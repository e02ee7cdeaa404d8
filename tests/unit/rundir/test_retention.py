"""The one retention policy (andrea/rundir/retention.py): keep_last, keep_every, keep_best and the spared steps, as
plain functions over plain data, and the run's Retention that the writers and the replica share."""

from __future__ import annotations

import pytest

from andrea.rundir.retention import Policy, Retention, best, kept_for_good, victims


@pytest.mark.parametrize("steps, keep_last, keep_every, gone", [
    ([100, 200, 300, 400, 500, 600, 700], 5, 10_000, [100, 200]),
    ([9900, 10000, 10100, 10200], 2, 10_000, [9900]),
    ([10000, 20000, 20100], 1, 10_000, []),
    ([100, 200, 300], 5, 0, []),
    ([100, 200, 300], 1, 0, [100, 200]),
])
def test_retention_keeps_recent_and_major(steps, keep_last, keep_every, gone):
    assert victims(steps, Policy(keep_last, keep_every)) == gone


def test_spared_steps_are_never_victims_and_count_as_kept_for_good():
    assert victims([10, 20, 30, 40], Policy(keep_last=1), spared=[20]) == [10, 30]
    assert kept_for_good([10, 20, 30, 40], Policy(keep_last=1), spared=[20, 99]) == {20}  # 99: not present


def test_keep_best_keeps_the_lowest_held_out_losses_of_the_steps_present():
    scores = {10: 3.0, 20: 2.5, 30: 2.7, 40: 2.9, 50: 3.1}
    assert best([10, 20, 30, 40, 50], scores, 2) == {20, 30}
    assert victims([10, 20, 30, 40, 50, 60], Policy(keep_last=1, keep_best=2), scores=scores) == [10, 40, 50]
    assert victims([10, 40, 50, 60], Policy(keep_last=1, keep_best=2), scores=scores) == [50]  # among those present
    assert victims([10, 20, 30], Policy(keep_last=1, keep_best=0), scores=scores) == [10, 20]  # 0: off
    # a step without an eval, or with a non-finite one, is no candidate
    assert best([10, 15, 20], {10: float("nan"), 20: 4.0}, 2) == {20}
    assert best([10, 20], {10: 1.0, 20: 1.0}, 1) == {10}  # ties: the older


def test_the_runs_retention_reads_its_spares_and_scores_at_each_call_and_refuses_a_second_wiring():
    spared, scores = {20}, {30: 1.0}
    r = Retention(Policy(keep_last=1, keep_best=1), lambda: scores)
    r.spare("guard", lambda: spared)
    assert r.victims([10, 20, 30, 40]) == [10]
    spared.clear()
    scores[10] = 0.5  # a better eval arrived
    assert r.victims([10, 20, 30, 40]) == [20, 30]
    assert r.victims([10, 20, 30, 40], also=[30]) == [20]
    with pytest.raises(ValueError, match="guard"):
        r.spare("guard", tuple)
