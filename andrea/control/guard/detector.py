"""The divergence guard's detector: whether a step's loss and gradient norm show the run leaving its basin.

Detection (why robust statistics): a healthy loss is noisy (a batch of 8 sequences moves it by 10-15 %), the
bandit shifts the mixture every few steps and the gradient norm of a healthy run spikes 4x on single batches.
So each signal is compared with the median of its recent *healthy* values plus a band of
max(sigmas · 1.4826 · MAD, margin · median) — the MAD term adapts to the run's own noise, the relative
margin keeps the band open while the window is young (a single value has MAD 0). A value above either band
is an anomaly; anomalies never enter the baseline (a divergence must not drag its own reference up). An
*incident* is `persist` anomalies among the last `persist_window` records — one noisy batch never is one —
or any non-finite loss or gradient norm, which is one at once. Before the first record the baseline is
empty and the first record (the loss of the initial state, about ln(vocab)) seeds it: a run at lr = 1.0
that leaves its basin at step 4 is caught by step 6.

The warm-up grace (the gradient norm only): a healthy run's gradient norm spikes 10-58x its median on single
steps just after the learning-rate warm-up ends (andrea-tiny, ten seeds: steps 22-41 of a 20-step warm-up, each
spike gone within three steps; after step 60 never above 3.3x; bench/guard_series.py measures it). No band over
a young, smoothly falling baseline tells those from a divergence. So until header step
`warmup_steps + window` the gradient norm is never an anomaly (and a value above its band stays out of the
baseline, which is full and settled when the grace ends); the loss and non-finite values are judged from the
first record, and they are what a real divergence moves (lr = 1.0 sends the loss from 6 to 80).

Its state is the `detector` object of the guard's companion (control/guard/decisions.py: `Guard.to_state`):
{"losses": [...], "grads": [...], "flags": [...]}, the newest `window` healthy values and the anomaly flags of the
last `persist_window` records. Pure: plain lists in, a verdict out (healthy | suspect | incident).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from andrea.config.keepers import GuardConfig

HEALTHY, SUSPECT, INCIDENT = "healthy", "suspect", "incident"
MAD_TO_SIGMA = 1.4826  # MAD of a normal distribution times this = its standard deviation


class GuardStateError(ValueError):
    """A guard companion that cannot be used; the message names the field."""


def _median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else 0.5 * (s[mid - 1] + s[mid])


def band(values: list[float], sigmas: float, margin: float) -> float:
    """Upper edge of the healthy band: median + max(sigmas · robust sigma, margin · |median|)."""
    med = _median(values)
    mad = _median([abs(v - med) for v in values])
    return med + max(sigmas * MAD_TO_SIGMA * mad, margin * abs(med))


@dataclass
class Detector:
    """Robust baseline of loss and gradient norm with k-of-m persistence (state: plain lists)."""

    cfg: GuardConfig
    losses: list[float] = field(default_factory=list)
    grads: list[float] = field(default_factory=list)
    flags: list[bool] = field(default_factory=list)

    def feed(self, loss: float, grad_norm: float, judge_grad: bool = True) -> tuple[str, str]:
        """(verdict, reason) for one record; healthy values join the baseline. `judge_grad` False (the warm-up
        grace): a gradient norm above its band is no anomaly, and stays out of the baseline."""
        c = self.cfg
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.flags = (self.flags + [True])[-c.persist_window:]
            return INCIDENT, f"loss {loss} / grad norm {grad_norm} is not finite"
        reasons, grad_outlier = [], False
        if self.losses:
            edge = band(self.losses, c.loss_sigmas, c.loss_margin)
            if loss > edge:
                reasons.append(f"loss {loss:.4g} above its band {edge:.4g}")
        if self.grads:
            edge = band(self.grads, c.grad_sigmas, c.grad_margin)
            grad_outlier = grad_norm > edge
            if grad_outlier and judge_grad:
                reasons.append(f"grad norm {grad_norm:.4g} above its band {edge:.4g}")
        anomalous = bool(reasons)
        self.flags = (self.flags + [anomalous])[-c.persist_window:]
        if not anomalous:
            self.losses = (self.losses + [loss])[-c.window:]
            if not grad_outlier:
                self.grads = (self.grads + [grad_norm])[-c.window:]
            return (SUSPECT if any(self.flags) else HEALTHY), ""
        count = sum(self.flags)
        if count >= c.persist:
            return INCIDENT, f"{'; '.join(reasons)} ({count} of the last {len(self.flags)} steps anomalous)"
        return SUSPECT, "; ".join(reasons)

    @property
    def quiet(self) -> bool:
        return not any(self.flags)

    def to_state(self) -> dict[str, Any]:
        return {"losses": list(self.losses), "grads": list(self.grads), "flags": list(self.flags)}

    @classmethod
    def from_state(cls, cfg: GuardConfig, d: Any) -> "Detector":
        if not isinstance(d, dict):
            raise GuardStateError("detector: not an object")
        try:
            losses = [float(x) for x in d["losses"]]
            grads = [float(x) for x in d["grads"]]
            flags = [bool(x) for x in d["flags"]]
        except (KeyError, TypeError, ValueError) as e:
            raise GuardStateError(f"detector: {e}") from None
        return cls(cfg, losses[-cfg.window:], grads[-cfg.window:], flags[-cfg.persist_window:])
