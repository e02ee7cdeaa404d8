"""Loss-curve figures (matplotlib, headless): one run with its life events marked, or two runs compared.

Reads ledger entries (control/ledger.py); writes a PNG.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend chosen first: no display on servers)

from andrea.control.ledger import ema, history  # noqa: E402

EVENT_STYLE = {"resume": ("tab:gray", ":"), "pivot": ("tab:red", "--"), "branch": ("tab:purple", "-.")}


def plot_run(run_dir: Path, entries: list[dict], out: Path) -> None:
    steps = history(entries)
    fig, ax = plt.subplots(figsize=(10, 5))
    xs, ys = [e["step"] for e in steps], [e["loss"] for e in steps]
    ax.plot(xs, ys, lw=0.6, alpha=0.4, label="loss")
    ax.plot(xs, ema(ys), lw=1.6, label="loss EMA (β=0.99)")
    evals = [e for e in entries if e.get("event") == "eval"]
    if evals:
        ax.plot([e["step"] for e in evals], [e["val_loss"] for e in evals], "o-", ms=3, label="validation")
    labelled = set()
    for e in entries:
        style = EVENT_STYLE.get(e.get("event"))
        if style:
            ax.axvline(e["step"], color=style[0], ls=style[1], lw=1,
                       label=None if e["event"] in labelled else e["event"])
            labelled.add(e["event"])
    ax.set(xlabel="step", ylabel="loss", title=str(run_dir))
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def plot_compare(dirs: list[Path], curves: list[list[dict]], start: int, out: Path) -> None:
    fig, ax = plt.subplots(figsize=(10, 5))
    for d, c in zip(dirs, curves):
        xs, ys = [e["step"] for e in c], [e["loss"] for e in c]
        (line,) = ax.plot(xs, ys, lw=0.6, alpha=0.35)
        ax.plot(xs, ema(ys), lw=1.6, color=line.get_color(), label=f"{d.name} (EMA)")
    ax.axvline(start, color="tab:purple", ls="-.", lw=1, label=f"branch point ({start})")
    ax.set(xlabel="step", ylabel="loss", title="compare")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
