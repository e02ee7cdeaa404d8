"""Loss-curve figures (matplotlib, headless): one run with its life events marked, or two runs compared.

Reads ledger entries (control/run/ledger_feed.py); writes one figure file (PNG, or any format its suffix names).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend chosen first: no display on servers)
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402

from andrea.rundir.ledger import ema, history, live_markers  # noqa: E402

EMA_LABEL = "loss EMA (β=0.99, bias-corrected, at its mean step)"


def figure_format_problem(out: Path) -> str | None:
    """Why matplotlib cannot write a figure to `out` (its suffix names the format); None when it can."""
    formats = FigureCanvasAgg.get_supported_filetypes()
    suffix = out.suffix[1:].lower()
    if suffix in formats:
        return None
    return (f"{'no file suffix' if not suffix else f'.{suffix} is not a figure format'}: "
            f"name it .png (or {', '.join('.' + f for f in sorted(formats) if f != 'png')})")


def smoothed(xs: list[int], ys: list[float]) -> tuple[list[float], list[float]]:
    """The loss EMA as drawn: each value placed at the mean step of the losses it averages.

    ema(ys)[t] is what `status` reports at step xs[t], but it averages the losses of ~100 earlier steps: drawn
    at xs[t] it trails a falling curve by up to β/(1-β) = 99 steps, which reads like a worse run than it is.
    The same weights give the mean step ema(xs)[t]; on any linear stretch of the curve ema(ys)[t] is exactly
    the loss there, so the line lies on the curve. It ends at ema(xs)[-1], short of the last step by the
    window's mean age: the last ~100 steps have no settled average yet.
    """
    return ema([float(x) for x in xs]), ema(ys)


def live_evals(entries: list[dict]) -> list[dict]:
    return live_markers(entries, "eval")


EVENT_STYLE = {"resume": ("tab:gray", ":"), "pivot": ("tab:red", "--"), "branch": ("tab:purple", "-."),
               "incident": ("tab:orange", ":"), "rollback": ("tab:green", "--"), "guard_stop": ("black", "-")}
# incident at the step the guard saw the divergence; rollback at the step it resumed from (control/guard/decisions.py)


def distinct_target(evals: list[dict]) -> list[dict]:
    """The eval markers whose policy.target loss is not the validation loss itself: with the default target (the
    arms' plain mean) the two are the same number up to float summation (they differ in the 16th digit), and a
    second line would only look like a second validation curve."""
    return [e for e in evals if e.get("target_loss") is not None
            and not math.isclose(e["target_loss"], e["val_loss"], rel_tol=1e-6, abs_tol=1e-9)]


def plot_run(run_dir: Path, entries: list[dict], out: Path) -> None:
    steps = history(entries)
    fig, ax = plt.subplots(figsize=(11, 5.5), layout="constrained")
    xs, ys = [e["step"] for e in steps], [e["loss"] for e in steps]
    ax.plot(xs, ys, lw=0.6, alpha=0.4, label="training loss")
    ax.plot(*smoothed(xs, ys), lw=1.6, label=EMA_LABEL)
    evals = live_evals(entries)
    if evals:
        ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", ms=3, label="validation loss")
        targeted = distinct_target(evals)
        if targeted:  # policy.target weighs the arms unevenly: the objective the data mixture serves
            ax.plot([e["step"] for e in targeted], [e["target_loss"] for e in targeted], "s:", ms=3,
                    label="validation loss weighted by policy.target")
    labelled = set()
    for e in entries:
        style = EVENT_STYLE.get(e.get("event"))
        if style:
            ax.axvline(e["step"], color=style[0], ls=style[1], lw=1,
                       label=None if e["event"] in labelled else e["event"])
            labelled.add(e["event"])
    ax.set(xlabel="step", ylabel="loss",
           title=f"{run_dir.resolve().name}: loss, steps {xs[0]:,}-{xs[-1]:,}" if xs else run_dir.name)
    handles, labels = ax.get_legend_handles_labels()
    scored = live_markers(entries, "tasks")
    if scored:  # eval.tasks: accuracy on its own axis (a higher line is better, unlike the loss)
        acc = ax.twinx()
        for key, marker in (("acc", "^-"), ("acc_norm", "v-")):
            acc.plot([e["step"] for e in scored], [e[key] for e in scored], marker, ms=3, color="tab:brown",
                     alpha=1.0 if key == "acc_norm" else 0.5, label=f"{scored[-1]['tasks']} {key}")
        acc.set(ylabel="task accuracy", ylim=(0, 1))
        more = acc.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    fig.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 4), fontsize="small")
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_compare(dirs: list[Path], entries: list[list[dict]], curves: list[list[dict]], start: int, common: int,
                 out: Path) -> None:
    """Two runs from their branch point: each run's loss and EMA (at its mean step), then the EMA's value at
    `common` (the step compare's verdict names) as a marked point the line is carried to; each run's validation
    loss (and its policy.target loss where it is not the same number) after the branch point."""
    fig, ax = plt.subplots(figsize=(11, 5.5), layout="constrained")
    for d, run_entries, c in zip(dirs, entries, curves):
        name = d.resolve().name
        xs, ys = [e["step"] for e in c], [e["loss"] for e in c]
        (line,) = ax.plot(xs, ys, lw=0.6, alpha=0.35)
        color = line.get_color()
        mx, my = smoothed(xs, ys)
        ax.plot(mx, my, lw=1.6, color=color, label=f"{name}: loss EMA (at its mean step)")
        upto = [y for x, y in zip(xs, ema(ys)) if x <= common]
        if upto and mx:  # the verdict's value, where the verdict names it
            ax.plot([mx[len(upto) - 1], common], [my[len(upto) - 1], upto[-1]], ":", lw=1.2, color=color)
            ax.plot([common], [upto[-1]], "o", ms=6, color=color, label=f"{name}: EMA at step {common:,}: "
                                                                           f"{upto[-1]:.4f}")
        evals = live_evals(run_entries)
        if evals:
            ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "D--", ms=4, lw=1, color=color,
                    label=f"{name}: validation loss")
            targeted = distinct_target(evals)
            if targeted:
                ax.plot([e["step"] for e in targeted], [e["target_loss"] for e in targeted], "s:", ms=4, lw=1,
                        color=color, label=f"{name}: validation weighted by policy.target")
    ax.axvline(start, color="tab:purple", ls="-.", lw=1, label=f"branch point (step {start:,})")
    names = [d.resolve().name for d in dirs]
    ax.set(xlabel="step", ylabel="loss", title=f"{names[0]} vs {names[1]}, from step {start:,}")
    handles, labels = ax.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize="small")
    fig.savefig(out, dpi=120)
    plt.close(fig)
