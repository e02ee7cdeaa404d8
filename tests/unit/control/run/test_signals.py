"""The step-boundary decisions, as plain functions: no signals, no sleeping."""

from andrea.control.run.signals import Requests, boundary_action, checkpoint_target


def test_usr1_alignment_step_or_cadence():
    assert checkpoint_target(41, 100, "step") == 42
    assert checkpoint_target(112_619, 100, "cadence") == 112_700  # docs/operating.md#pivots-and-branches's pivot
    assert checkpoint_target(99, 100, "cadence") == 100


def test_requests_coalesce_until_the_checkpoint_lands():
    req = Requests()
    assert req.ask_checkpoint(10, 100, "step") is True
    assert req.ask_checkpoint(10, 100, "step") is False
    assert req.checkpoint_at == 11 and req.checkpoint_asked == 2
    req.checkpoint_at, req.landing = None, 11  # taken, commit in flight
    assert req.ask_checkpoint(12, 100, "step") is False
    req.landing = None  # landed
    assert req.ask_checkpoint(12, 100, "step") is True and req.checkpoint_at == 13


def test_boundary_actions():
    req = Requests()
    assert boundary_action(50, 1000, 100, req) == boundary_action(50, 1000, 100, Requests())
    assert not boundary_action(50, 1000, 100, req).checkpoint
    assert boundary_action(100, 1000, 100, req).checkpoint
    assert not boundary_action(0, 1000, 100, req).checkpoint  # never a cadence checkpoint of the initial state
    final = boundary_action(1000, 1000, 100, req)
    assert final.checkpoint and final.stop
    req.stop = "SIGTERM"
    act = boundary_action(57, 1000, 100, req)
    assert act.checkpoint and act.stop and "SIGTERM" in act.reason
    req = Requests()
    req.ask_checkpoint(56, 100, "step")
    act = boundary_action(57, 1000, 100, req)
    assert act.checkpoint and not act.stop and act.reason == "SIGUSR1"
    req.pivot = True
    assert boundary_action(57, 1000, 100, req).pivot


def test_a_pivot_does_not_coalesce_into_a_checkpoint_already_landing():
    req = Requests()
    req.ask_checkpoint(10, 100, "step")
    req.checkpoint_at, req.landing = None, 11  # the SIGUSR1 checkpoint is taken, its commit in flight
    req.ask_pivot(12, 100, "step")
    act = boundary_action(13, 1000, 100, req)
    assert req.checkpoint_at == 13 and act.checkpoint and act.pivot
    req = Requests()
    req.ask_checkpoint(10, 100, "step")  # pending, not yet taken: the pivot rides on it
    req.ask_pivot(10, 100, "step")
    assert req.checkpoint_at == 11 and boundary_action(11, 1000, 100, req).pivot
