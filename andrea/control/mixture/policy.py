"""The operator's data policy as the bandit sees it: per-arm share bounds and the objective, and the projection that
makes any distribution obey the bounds. Pure functions over plain data; no I/O.

`validate_policy` turns `[policy]`'s caps, floors and target (config/schema.py) into a `Policy` over the configured arms,
or one `PolicyError` line naming the arm or the sum; `project_capped_simplex` is the Euclidean projection onto
{x : Σx = 1, lo ≤ x ≤ hi} that control/mixture/bandit.py applies to every mixture it samples. `Policy.fingerprint` is what
`.state.json` records to tell a resume from a pivot (control/mixture/proxy.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass

import numpy as np

from andrea.errors import UserError


class PolicyError(UserError, ValueError):
    """Caps/floors that cannot define a mixture; the message is one line naming the arm or the sum."""


@dataclass(frozen=True)
class Policy:
    """Per-arm share bounds in arm order: lo[i] ≤ share of arms[i] ≤ hi[i]; validated by `validate_policy`."""

    arms: tuple[str, ...]
    lo: tuple[float, ...]
    hi: tuple[float, ...]
    target: tuple[float, ...] = ()  # normalised objective weights (sum 1); () = equal over the arms
    target_raw: tuple[tuple[str, float], ...] = ()  # the operator's entries other than the default 1

    def target_weights(self) -> np.ndarray:
        return np.array(self.target, dtype=np.float64) if self.target else np.full(len(self.arms), 1 / len(self.arms))

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        return np.array(self.lo, dtype=np.float64), np.array(self.hi, dtype=np.float64)

    def fingerprint(self) -> str:
        """16 hex digits over the arms that carry a cap or floor and their bounds, independent of arm order.

        Unbounded arms (floor 0, cap 1) are left out on purpose: adding a source or losing one (the zombie arm of
        docs/formats.md) does not change what the operator asked for, so the other arms keep what they learned; any
        change to a cap or floor, or to which arm carries one, is a pivot.
        The target's non-default weights count too (a new objective is a new policy); an all-default target
        leaves the fingerprint as it was before targets existed.
        """
        bounded: list = sorted((a, lo, hi) for a, lo, hi in zip(self.arms, self.lo, self.hi) if (lo, hi) != (0.0, 1.0))
        if self.target_raw:
            bounded = [bounded, sorted(self.target_raw)]
        return hashlib.sha256(json.dumps(bounded).encode()).hexdigest()[:16]


def validate_policy(arms: list[str], caps: dict[str, float], floors: dict[str, float],
                    target: dict[str, float] | None = None) -> Policy:
    """Build the Policy for `arms`; arms without a cap get 1, without a floor 0, without a target weight 1.
    Raises PolicyError."""
    target = {} if target is None else target
    if not arms:
        raise PolicyError("policy: no arms configured")
    if len(set(arms)) != len(arms):
        raise PolicyError(f"policy: arm names must be unique, got {list(arms)}")
    for table, values in (("caps", caps), ("floors", floors), ("target", target)):
        for arm, value in values.items():
            if arm not in arms:
                raise PolicyError(f"policy.{table}: unknown arm {arm!r} (configured arms: {', '.join(arms)})")
            top = math.inf if table == "target" else 1.0  # target weights are relative: normalised to sum 1
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= top:
                raise PolicyError(f"policy.{table}[{arm!r}]={value!r} must be a number in "
                                  + ("[0, inf)" if table == "target" else "[0, 1]"))
    if math.fsum(float(target.get(a, 1.0)) for a in arms) <= 0.0:
        raise PolicyError("policy.target: every configured arm has weight 0: the objective is empty")
    lo = tuple(float(floors.get(a, 0.0)) for a in arms)
    hi = tuple(float(caps.get(a, 1.0)) for a in arms)
    for arm, l, h in zip(arms, lo, hi):
        if h < l:
            raise PolicyError(f"policy: arm {arm!r} has cap {h!r} below its floor {l!r}")
    # fsum is exactly rounded: floors written as 0.2/0.3/0.5 sum to 1, not 1.0000000000000002.
    if math.fsum(lo) > 1.0:
        raise PolicyError(f"policy.floors sum to {math.fsum(lo):.6g} > 1: they cannot all be met")
    if math.fsum(hi) < 1.0:
        raise PolicyError(f"policy.caps sum to {math.fsum(hi):.6g} < 1 (uncapped arms count 1): "
                          "the mixture cannot fill the simplex")
    raw = [float(target.get(a, 1.0)) for a in arms]
    weights = tuple(w / math.fsum(raw) for w in raw)
    return Policy(tuple(arms), lo, hi, weights, tuple((a, w) for a, w in zip(arms, raw) if w != 1.0))


def project_capped_simplex(p: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Euclidean projection of p onto {x : Σx = 1, lo ≤ x ≤ hi} (float64).

    The projection is clip(p − τ, lo, hi) for the τ at which it sums to 1 (KKT); Σ clip(p − τ) falls as τ grows,
    so τ is found by bisection down to adjacent floats, then re-solved exactly on the active set it reveals.
    The final fix-up moves the leftover rounding residual (a few ulps) onto an arm strictly inside its bounds
    and clips again, so lo ≤ x ≤ hi holds exactly (no tolerance) and Σx = 1 to a few ulps.
    """
    p, lo, hi = (np.asarray(a, dtype=np.float64) for a in (p, lo, hi))
    if not (p.ndim == 1 and p.shape == lo.shape == hi.shape and p.size > 0):
        raise ValueError(f"project_capped_simplex: shapes {p.shape}, {lo.shape}, {hi.shape} must be equal and 1-D")
    if not (np.isfinite(p).all() and np.all(lo <= hi) and math.fsum(lo) <= 1.0 <= math.fsum(hi)):
        raise ValueError("project_capped_simplex: p must be finite and lo ≤ hi, Σlo ≤ 1 ≤ Σhi")
    below, above = float(np.min(p - hi)), float(np.max(p - lo))  # Σx ≥ 1 at τ=below, ≤ 1 at τ=above
    for _ in range(2200):  # enough halvings to cross the whole float64 exponent range
        mid = 0.5 * (below + above)
        # ~1 ulp of τ is enough: τ only has to reveal the active set, the closed form below does the rest.
        if mid <= below or mid >= above or above - below <= 2e-16 * max(1.0, abs(below), abs(above)):
            break
        if np.clip(p - mid, lo, hi).sum() > 1.0:
            below = mid
        else:
            above = mid
    # g(τ) can be flat at 1 over an interval (then τ is not unique, x is): re-solve τ in closed form on the
    # active set found by bisection, so coordinates that belong on a bound land on it exactly, not an ulp off.
    shifted = p - 0.5 * (below + above)
    free = (shifted > lo) & (shifted < hi)
    x = np.where(shifted <= lo, lo, hi)
    if free.any():
        x[free] = p[free] - (p[free].sum() - (1.0 - x[~free].sum())) / np.count_nonzero(free)
    x = np.clip(x, lo, hi)
    for _ in range(2 * p.size):  # each pass absorbs the residual or saturates one arm
        residual = 1.0 - x.sum()
        if residual == 0.0:
            break
        room = hi - x if residual > 0 else x - lo
        # Arms strictly inside their bounds first: an arm on a bound belongs there (KKT), an ulp off it is noise.
        inside = (x > lo) & (x < hi)
        i = int(np.argmax(np.where(inside, room, -1.0))) if inside.any() else int(np.argmax(room))
        if room[i] <= 0.0:
            break
        x[i] = min(max(x[i] + residual, lo[i]), hi[i])
    return x
