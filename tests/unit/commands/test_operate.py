"""The loss EMA of `status`, `plot` and `compare` is bias-corrected: closed forms an uncorrected EMA misses.

Two uncorrected variants exist and each fails here: zero-initialised (c·(1 − β^t) on a constant c: starts near 0)
and first-value-initialised (weight β^(t−1) on the first loss: 37 % of the value at t = 100, 13 % at t = 200 —
a high first loss drags it for hundreds of steps). The corrected EMA at t is Σ β^(t−i)·v_i / Σ β^(t−i).
`plot` draws each value at the mean step it averages (plots.smoothed), so the line does not trail the curve,
and only the evals that no later marker superseded.
"""

import numpy as np
import pytest

from andrea.commands.operate import loss_ema
from andrea.rundir.ledger import EMA_BETA, ema, history, marker

B = EMA_BETA


def test_constant_series_is_its_own_ema_from_the_first_step():
    assert ema([3.5] * 500) == pytest.approx([3.5] * 500, rel=1e-12)


def test_a_high_first_loss_fades_with_the_corrected_weight():
    values = ema([10.0] + [4.0] * 300)
    for t in (2, 10, 100, 200, 301):
        expected = 4.0 + 6.0 * (1 - B) * B ** (t - 1) / (1 - B ** t)
        assert values[t - 1] == pytest.approx(expected, rel=1e-12)
    assert values[99] < 4.04  # first-value-initialised: 4 + 6·β^99 = 6.22


def test_step_change_has_the_closed_form():
    a, b, n = 2.0, 1.0, 50
    values = ema([a] * n + [b] * 250)
    for t in (n, n + 1, n + 100, n + 250):
        k = t - n  # steps since the change
        expected = (a * B ** k * (1 - B ** n) + b * (1 - B ** k)) / (1 - B ** t)
        assert values[t - 1] == pytest.approx(expected, rel=1e-12)


def test_ema_is_the_normalised_exponentially_weighted_mean():
    v = np.random.default_rng(0).normal(4.0, 0.3, 400)
    for t in (1, 7, 150, 400):
        w = B ** np.arange(t - 1, -1, -1)
        assert ema(list(v))[t - 1] == pytest.approx(float(w @ v[:t] / w.sum()), rel=1e-12)


def test_status_ema_runs_over_the_effective_history():
    entries = [marker("start", 0)] + [{"step": s, "loss": 9.0} for s in range(1, 31)]  # superseded 21..30
    entries += [marker("resume", 20)] + [{"step": s, "loss": 1.0} for s in range(21, 41)]
    steps, values = zip(*loss_ema(history(entries)))
    assert list(steps) == list(range(1, 41))
    w = B ** np.arange(39, -1, -1)
    assert values[-1] == pytest.approx(float(w @ np.r_[np.full(20, 9.0), np.full(20, 1.0)] / w.sum()), rel=1e-12)


def test_plotted_ema_lies_on_a_linear_curve_instead_of_trailing_it():
    from andrea.control.observe.plots import smoothed
    steps = list(range(1, 1001))
    loss = [6.0 - 0.002 * s for s in steps]  # a falling stretch: 0.2 nats per 100 steps
    xs, ys = smoothed(steps, loss)
    assert ys == ema(loss)  # the values are status' EMA; only where they are drawn changes
    assert max(abs(y - (6.0 - 0.002 * x)) for x, y in zip(xs, ys)) < 1e-9
    age = B / (1 - B) - 1000 * B ** 1000 / (1 - B ** 1000)  # the window's mean age at t = 1000: ~99 steps
    assert xs[-1] == pytest.approx(1000 - age, rel=1e-12)
    assert ys[-1] - loss[-1] == pytest.approx(0.002 * age, rel=1e-9)  # drawn at step 1000 it would trail


def test_plot_draws_only_the_evals_no_later_marker_superseded():
    from andrea.control.observe.plots import live_evals
    entries = [marker("start", 0), marker("eval", 50, val_loss=5.0), marker("eval", 100, val_loss=4.0),
               marker("resume", 50), marker("pivot", 60), marker("eval", 100, val_loss=3.5)]
    assert [(e["step"], e["val_loss"]) for e in live_evals(entries)] == [(50, 5.0), (100, 3.5)]
