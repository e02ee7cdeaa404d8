"""control/observe/plots.py: nothing drawn that is not there (the default policy.target loss, equal to the
validation loss up to float summation, is no second curve), legends off the data, titles naming the runs, and
compare's validation losses and EMA values at the step its verdict names. The figures are drawn for real (Agg)
and read back before they are closed."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from andrea.control.observe import plots


@pytest.fixture
def figures(monkeypatch):
    drawn = []
    close = plots.plt.close
    monkeypatch.setattr(plots.plt, "close", lambda fig: (drawn.append(fig), close(fig)))
    return drawn


def run_entries(shift: float = 0.0, target_gap: float = 1e-16) -> list[dict]:
    steps = [{"step": s, "loss": 5.0 - s / 100 + shift, "time": float(s)} for s in range(1, 201)]
    evals = [{"event": "eval", "step": s, "val_loss": 4.0 - s / 1000 + shift,
              "target_loss": 4.0 - s / 1000 + shift + target_gap, "time": float(s)} for s in (50, 100, 150, 200)]
    return sorted(steps + evals, key=lambda e: (e["step"], "event" in e))


def legend_texts(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_the_default_target_draws_no_second_validation_curve_and_the_legend_is_off_the_axes(figures, tmp_path):
    plots.plot_run(Path("runs/andrea-12m"), run_entries(), tmp_path / "a.png")
    [fig] = figures
    labels = legend_texts(fig)
    assert "validation loss" in labels and not [t for t in labels if "policy.target" in t], labels
    assert not fig.axes[0].get_legend()  # the legend is the figure's, below the axes: never over the curve
    assert fig.axes[0].get_title() == "andrea-12m: loss, steps 1-200"
    plots.plot_run(Path("runs/x"), run_entries(target_gap=0.05), tmp_path / "b.png")  # a real target
    assert "validation loss weighted by policy.target" in legend_texts(figures[1])


def test_compare_names_both_runs_draws_their_validation_and_marks_the_verdicts_step(figures, tmp_path):
    a, b = run_entries(), run_entries(shift=0.1, target_gap=0.05)
    curves = [[e for e in r if "event" not in e and e["step"] >= 100] for r in (a, b)]
    plots.plot_compare([Path("runs/parent"), Path("runs/branch")], [[e for e in r if e["step"] >= 100]
                                                                    for r in (a, b)], curves, 100, 200,
                       tmp_path / "c.png")
    [fig] = figures
    assert fig.axes[0].get_title() == "parent vs branch, from step 100"
    labels = legend_texts(fig)
    assert {"parent: validation loss", "branch: validation loss",
            "branch: validation weighted by policy.target"} <= set(labels), labels
    assert "parent: validation weighted by policy.target" not in labels
    marks = [line for line in fig.axes[0].get_lines() if list(line.get_xdata()) == [200]]
    values = sorted(float(line.get_ydata()[0]) for line in marks)
    ema = [plots.ema([e["loss"] for e in c])[-1] for c in curves]
    assert len(marks) == 2 and all(math.isclose(v, e) for v, e in zip(values, sorted(ema))), (values, ema)
