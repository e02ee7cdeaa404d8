"""The ledger's lines as named scalars: one mapping for every view of the run (control/observe/tensorboard.py,
control/observe/wandb_log.py), so TensorBoard and Weights & Biases chart the same values under the same names. Pure: no
files, no clock (the rate comes from the entries' own `time`).

    train/loss, train/lr, train/grad_norm   every step entry, the ledger's values
    train/mfu              a step entry's `mfu` (andrea/control/observe/mfu.py), where the run knows its device's peak
    train/tokens_per_s     every `log_every` steps: ledger tokens / ledger time since the last point (reset at a
                           start, resume, branch or rollback marker, so downtime never counts)
    val/loss               an `eval` marker's val_loss (the mean over arms)
    val/target_loss        its target_loss (policy.target's weighting of the arms: the objective of the mixture)
    val/<arm>              its per-arm held-out losses
    tasks/acc, tasks/acc_norm, tasks/acc_norm_chars   a `tasks` marker's multiple-choice accuracies
                           (eval.tasks: andrea/evals/audit.py's TaskAudit, andrea/evals/tasks.py)
"""

from __future__ import annotations

from typing import Any

from andrea.rundir.markers import RESETS  # markers after which the step can go back (ledger.history)


class LedgerScalars:
    """`of(line)` -> [(tag, value)] at the line's step; it carries the tokens/s rate from line to line."""

    def __init__(self, log_every: int):
        self.log_every = log_every
        self.rate_from: tuple[float, int] | None = None  # (ledger time, tokens) of the last tokens/s point

    def of(self, e: dict[str, Any]) -> list[tuple[str, float]]:
        event = e.get("event")
        if event is None:
            out = [(f"train/{key}", e[key]) for key in ("loss", "lr", "grad_norm")]
            if e.get("mfu") is not None:
                out.append(("train/mfu", e["mfu"]))
            return out + self._rate(e)
        if event in RESETS:
            self.rate_from = None
        elif event == "eval":
            out = [("val/loss", e["val_loss"])]
            if e.get("target_loss") is not None:  # policy.target's objective (absent before it existed)
                out.append(("val/target_loss", e["target_loss"]))
            return out + [(f"val/{arm}", value) for arm, value in e.get("arms", {}).items()]
        elif event == "tasks":
            return [(f"tasks/{key}", e[key]) for key in ("acc", "acc_norm", "acc_norm_chars") if key in e]
        return []

    def _rate(self, e: dict[str, Any]) -> list[tuple[str, float]]:
        if self.rate_from is None:
            self.rate_from = (e["time"], e["tokens"])
        elif e["step"] % self.log_every == 0 and e["time"] > self.rate_from[0]:
            t0, tokens0 = self.rate_from
            self.rate_from = (e["time"], e["tokens"])
            return [("train/tokens_per_s", (e["tokens"] - tokens0) / (e["time"] - t0))]
        return []
