"""bench/chaos_plan.py: the chaos run's decisions over plain data (no process, file or clock).

The supervisor's next move after each exit (restore, restart, done, or stop short), the goodput arithmetic and the
fault-free rate it divides by, the attribution of ledger markers and notices to the fault that caused them, and the
per-fault recovery figures read from a ledger.
"""

from __future__ import annotations

import pytest

from andrea.rundir.ledger import history
from bench import chaos_plan as plan
from bench.chaos_plan import DirState, Injected

HERE = DirState(gone=False, restore_partial=False, newest=40)


def steps(first: int, last: int, t0: float, dt: float = 1.0) -> list[dict]:
    return [{"step": s, "loss": 1.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 8 * s, "phase": 0,
             "time": t0 + (s - first) * dt} for s in range(first, last + 1)]


# --- the supervisor ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rc", [1, 75, -9, 137])
def test_a_non_zero_exit_is_started_again(rc):
    assert plan.decide(rc, HERE, target=100, stop_requested=False) == plan.RESTART


def test_a_refused_configuration_is_not_started_again():
    assert plan.decide(2, HERE, target=100, stop_requested=False) == plan.REFUSED


def test_a_lost_run_directory_is_restored_whatever_the_exit():
    for rc in (0, 1, -9):
        assert plan.decide(rc, DirState(True, False, None), 100, False) == plan.RESTORE
    assert plan.decide(0, DirState(False, True, None), 100, False) == plan.RESTORE  # a restore left half done


def test_exit_0_at_the_target_is_done_and_short_of_it_is_a_stop_unless_the_chaos_asked_for_it():
    assert plan.decide(0, DirState(False, False, 100), 100, False) == plan.DONE
    assert plan.decide(0, HERE, 100, stop_requested=True) == plan.RESTART  # a preemption: start again
    # exit 0 below the target, nobody asked (a final checkpoint held back): systemd would stay stopped, and a
    # restart would repeat it forever
    assert plan.decide(0, HERE, 100, stop_requested=False) == plan.SHORT


# --- goodput ----------------------------------------------------------------------------------------------------
def test_goodput_is_steps_kept_over_wall_time_at_the_fault_free_rate():
    assert plan.goodput(100, 10.0, 10.0) == pytest.approx(1.0)
    assert plan.goodput(100, 20.0, 10.0) == pytest.approx(0.5)  # half the wall lost to faults
    with pytest.raises(ValueError):
        plan.goodput(100, 0.0, 10.0)


def test_the_fault_free_rate_skips_the_first_step_and_pools_only_the_time_processes_trained():
    led = steps(1, 11, 100.0, dt=0.5)
    led[0]["time"] = 90.0  # the first step pays for the warm-up
    assert plan.steady_rate(led) == pytest.approx(2.0)
    two = steps(1, 11, 100.0) + [{"event": "resume", "step": 11, "time": 150.0}] + steps(12, 22, 160.0, dt=0.5)
    # the 40 s restart between the spans is not training time
    rate = plan.segment_rate(two, [(99.0, 111.0), (150.0, 200.0)])
    assert rate == pytest.approx((9 + 9) / (9 + 4.5))


# --- attribution -------------------------------------------------------------------------------------------------
def test_markers_and_notices_belong_to_the_newest_fault_injected_at_or_before_them():
    faults = [Injected("sigkill", at=10.0), Injected("outage", at=20.0)]
    assert plan.attribute([5.0, 10.0, 15.0, 25.0], faults) == [None, 0, 0, 1]


def test_expected_names_match_any_candidate_and_missing_ones_are_none():
    found = plan.matches((("resume",), ("quarantine",)), ["resume", "eval"])
    assert found == [("resume", "resume"), ("quarantine", None)]
    assert plan.matches((("stall", "hang"),), ["eval", "hang"]) == [("stall|hang", "hang")]


# --- recovery ----------------------------------------------------------------------------------------------------
def test_a_crash_s_steps_lost_and_seconds_to_the_first_new_step():
    led = steps(1, 57, 0.0) + [{"event": "resume", "step": 50, "time": 70.0}] + steps(51, 60, 72.5)
    f = Injected("sigkill", at=56.5, exit_at=57.0, reached=57)
    r = plan.recovery(f, led)
    assert (r.reached, r.resumed, r.lost) == (57, 50, 7)
    assert r.seconds == pytest.approx(72.5 - 57.0)
    # the next fault struck the restart before its first step: the seconds after it are that fault's
    assert plan.recovery(f, led, until=65.0).seconds == pytest.approx(65.0 - 57.0)


def test_a_rollback_s_steps_lost_are_its_from_minus_its_checkpoint_and_no_rollback_loses_none():
    led = steps(1, 36, 0.0) + [{"event": "incident", "step": 36, "time": 35.2},
                               {"event": "rollback", "step": 20, "from": 36, "time": 35.5}] + steps(21, 30, 36.0)
    r = plan.recovery(Injected("poison", at=35.2), led)
    assert (r.reached, r.resumed, r.lost) == (36, 20, 16) and r.seconds == pytest.approx(36.0 - 35.2)
    quiet = plan.recovery(Injected("outage", at=10.0, reached=10), steps(1, 30, 0.0))
    assert (quiet.lost, quiet.seconds) == (0, None)


def test_settled_entries_are_the_effective_history_without_times():
    led = steps(1, 12, 0.0) + [{"event": "resume", "step": 10, "time": 20.0}] + steps(11, 12, 30.0)
    settled = plan.settled(history(led), upto=12)
    assert [e[0] for e in settled] == list(range(1, 13))  # superseded 11 and 12 dropped, the new ones kept
    assert settled == plan.settled(history(steps(1, 12, 500.0)), upto=12)  # times never count
    assert len(plan.settled(history(led), upto=10)) == 10


def test_every_fault_is_in_the_default_order_and_the_ones_riding_a_start_follow_an_exit():
    assert sorted(plan.ORDER) == sorted(plan.FAULTS)
    for i, kind in enumerate(plan.ORDER):
        if kind in ("poison", "hang"):
            assert i > 0 and plan.FAULTS[plan.ORDER[i - 1]].exits


def test_the_windows_between_faults_add_up_to_the_whole_loss_and_steps_trained_again_are_no_new_ground():
    # 10 steps at 1 step/s, a crash at 10.5 back to step 6, a 4 s restart, steps 7..20 again at 1 step/s
    led = steps(1, 10, 0.0) + [{"event": "resume", "step": 6, "time": 14.0}] + steps(7, 20, 15.0)
    assert plan.high_water(led, 17.0) == 10  # steps 7-9 trained again are not new ground
    assert plan.high_water(led, 19.0) == 11
    before = plan.window_loss(led, -1.0, 10.5, rate=1.0)  # from before step 1 (at t = 0) to the crash
    after = plan.window_loss(led, 10.5, 28.0, rate=1.0)
    assert before == (10, pytest.approx(1.5)) and after == (10, pytest.approx(7.5))  # 4 s restart + 3 steps again
    kept, wall = 20, 28.0 - (-1.0)
    assert before[1] + after[1] == pytest.approx(wall - kept / 1.0)  # the windows add up to the run's loss


def test_the_loss_of_the_machine_waits_until_the_replica_holds_a_checkpoint_past_a_poisoned_step():
    assert plan.loss_may_strike(None, None) and plan.loss_may_strike(10, None)
    assert not plan.loss_may_strike(None, 15) and not plan.loss_may_strike(10, 15) and not plan.loss_may_strike(15, 15)
    assert plan.loss_may_strike(20, 15)


# --- which fault broke the bytes ----------------------------------------------------------------------------------
FAULTS_RESUMED = [("kill", 40), ("poison", 30), ("flip", 60), ("outage", None), ("term", 80)]


def test_a_ledger_that_differs_names_the_last_recovery_that_trained_that_step_again():
    """Issue 55: a DIFFERENT verdict beside a list of faults that 'keep the bytes' said nothing of which one broke
    them. The settled entry of step 65 was written after the flip's recovery (from 60): the term's resumed at 80,
    above it, and the earlier ones were superseded by the flip's."""
    said = plan.first_broken(FAULTS_RESUMED, same_checkpoint=False, first_different_step=65, compared_through=100)
    assert said.startswith("fault #3 (flip) broke them") and "step 60" in said and "step 65" in said, said
    assert "fault #2 (poison)" in plan.first_broken(FAULTS_RESUMED, False, 31, 100)  # 31 > 30, not > 40
    assert "fault #5 (term)" in plan.first_broken(FAULTS_RESUMED, False, 81, 100)


def test_what_the_ledger_cannot_tell_is_said_and_no_fault_is_blamed():
    assert "before any fault's recovery" in plan.first_broken(FAULTS_RESUMED, False, 12, 100)
    said = plan.first_broken(FAULTS_RESUMED, same_checkpoint=False, first_different_step=None, compared_through=100)
    assert "cannot be told from the ledger" in said and "step 100" in said and "fault #" not in said
    assert plan.first_broken(FAULTS_RESUMED, True, None, 100) == "no fault changed the bytes"
