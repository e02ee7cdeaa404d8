"""The plateau notice (andrea/control/observe/plateau.py): due after N, 2N, ... evals without a new best held-out
loss, written as a ledger marker that is a notice."""

from __future__ import annotations

from types import SimpleNamespace

from andrea.control.observe.notify import from_marker
from andrea.control.observe.plateau import Plateau, due
from andrea.control.run.heldout import HeldOut
from andrea.control.run.observers import Observers


def test_due_after_n_evals_without_a_new_best_and_again_after_as_many_more():
    losses = {10: 3.0, 20: 2.5, 30: 2.6, 40: 2.5, 50: 2.7, 60: 2.8}
    assert due({s: v for s, v in losses.items() if s <= 20}, 2) is None  # 20 is the best: nothing since
    assert due({s: v for s, v in losses.items() if s <= 30}, 2) is None  # one eval since
    assert due({s: v for s, v in losses.items() if s <= 40}, 2) == (20, 2.5, 2)  # an equal loss is no new best
    assert due({s: v for s, v in losses.items() if s <= 50}, 2) is None
    assert due(losses, 2) == (20, 2.5, 4)
    assert due(losses, 0) is None and due({}, 1) is None
    assert due({10: float("nan"), 20: float("nan")}, 1) is None  # no finite best yet


def test_the_observer_writes_a_plateau_marker_that_is_a_notice_and_a_rollback_starts_it_over():
    heldout, feed = HeldOut(), SimpleNamespace(lines=[])
    told = Observers([heldout, Plateau(2, heldout, feed)])  # the boundary's order: the history first
    for step, loss in ((10, 3.0), (20, 2.5), (30, 2.6), (40, 2.7)):
        told.on_eval(step, loss)
    (line,) = feed.lines
    assert (line["event"], line["step"], line["best_step"], line["best_loss"], line["evals"]) == \
        ("plateau", 40, 20, 2.5, 2)
    kind, message = from_marker(line)
    assert kind == "plateau" and "no new best in 2 evals" in message and "step 20" in message
    told.on_rollback(30)  # the eval of 40 belongs to an abandoned timeline
    told.on_eval(40, 2.4)  # a new best
    told.on_eval(50, 2.6)
    assert len(feed.lines) == 1
    told.on_eval(60, 2.6)
    assert feed.lines[-1]["best_step"] == 40 and feed.lines[-1]["step"] == 60


def test_off_by_default():
    from andrea.config.keepers import NotifyConfig
    heldout, feed = HeldOut(), SimpleNamespace(lines=[])
    told = Observers([heldout, Plateau(NotifyConfig().plateau_evals, heldout, feed)])
    for step, loss in ((10, 1.0), (20, 2.0), (30, 3.0)):
        told.on_eval(step, loss)
    assert feed.lines == []
