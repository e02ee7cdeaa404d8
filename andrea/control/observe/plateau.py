"""The plateau notice: no new best held-out loss in `notify.plateau_evals` evals (a long run that stopped learning
tells its operator instead of burning its budget in silence).

Subscribes to the boundary's evals (control/run/observers.py) and reads the run's held-out history
(control/run/heldout.py: the effective timeline's evals, seeded from the ledger at a start, cut back at a rollback).
When the evals after the best one reach N, 2N, ..., a `plateau` marker joins the ledger's lines; rundir/markers.py
registers it with its notice's message and andrea/notices.py the notice kind, which goes out as the marker reaches
the I/O thread (control/observe/notify.py `lines`). `due` is the decision, a pure function over the losses.
Writes the `plateau` marker through the ledger feed (rank 0: the evals are its).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from andrea.control.run.observers import Observer
from andrea.rundir.ledger import marker


def due(losses: Mapping[int, float], n: int) -> tuple[int, float, int] | None:
    """(best step, best loss, evals since it) when the evals after the best finite one are a positive multiple of
    `n`, else None (and always None for n = 0: off). Equal losses are no new best."""
    if n <= 0:
        return None
    finite = [(v, s) for s, v in losses.items() if math.isfinite(v)]
    if not finite:
        return None
    best_loss, best_step = min(finite)
    since = sum(1 for s in losses if s > best_step)
    return (best_step, best_loss, since) if since and since % n == 0 else None


class Plateau(Observer):
    def __init__(self, n: int, heldout, feed):
        self.n, self.heldout, self.feed = n, heldout, feed

    def on_eval(self, step: int, val_loss: float) -> None:
        found = due(self.heldout.losses(), self.n)  # the history already holds this eval (subscribed first)
        if found is not None:
            best_step, best_loss, since = found
            self.feed.lines.append(marker("plateau", step, best_step=best_step, best_loss=best_loss, evals=since))
