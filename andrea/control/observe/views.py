"""The run's views of its ledger — TensorBoard (control/observe/tensorboard.py) and Weights & Biases
(control/observe/wandb_log.py) — behind one object, so the runtime, the boundary and the replicator tell "the views"
once what happened and each view that is on hears it. Writes nothing itself; every call only queues.
"""

from __future__ import annotations

from typing import Any


class Views:
    def __init__(self, *views):
        self.views = [v for v in views if v is not None]

    def add_records(self, lines: list[dict[str, Any]]) -> None:
        """Ledger lines, in ledger order (the caller does not mutate them afterwards)."""
        for v in self.views:
            v.add_records(lines)

    def add_checkpoint(self, step: int, state: dict[str, Any], stall_s: float) -> None:
        for v in self.views:
            v.add_checkpoint(step, state, stall_s)

    def on_commit(self, fut) -> None:
        """Done-callback of a commit future."""
        for v in self.views:
            v.on_commit(fut)

    def add_replica(self, step: int, lag_steps: int, lag_s: float) -> None:
        for v in self.views:
            v.add_replica(step, lag_steps, lag_s)

    def settle(self, step: int | None) -> None:
        """Nothing at or below `step` can be superseded any more (a view that streams only settled steps)."""
        if step is not None:
            for v in self.views:
                v.settle(step)

    def close(self, settled: int | None) -> None:
        """At the end of the process: what `settled` releases, then each view closed (each bounds its wait)."""
        for v in self.views:
            v.close(settled)


def open_views(*views) -> Views | None:
    """None when no view is on (the hot path then skips them entirely)."""
    return Views(*views) if any(v is not None for v in views) else None
