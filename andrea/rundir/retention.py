"""Which checkpoints a run keeps: one retention policy, the same for the local writers (control/commit/writer.py
and the sharded and gathered ones beside it) and the replica (control/replica/plan.py).

The rule, over plain data (the steps present, the steps spared, the held-out losses):
    keep_last   the newest `keep_last` steps
    keep_every  every multiple of `keep_every` (major checkpoints, never deleted; 0: none)
    keep_best   the `keep_best` steps with the lowest held-out loss (the `eval` marker at that very step; a step
                without one is no candidate; 0: none)
    spared      steps another part of the run must keep: the divergence guard's known-good and tentative points
                (control/guard/decisions.py `protected`), the replica's newest and uploading ones
                (control/replica/replicator.py `protected`)
Everything else present is deleted. `kept_for_good` is what survives whatever comes later (the milestones, the
best, the spared): what the replica uploads besides the newest.

`Retention` is the run's one policy, built once at the start and handed to the writer and the replicator at
construction: the parts that spare steps (`spare(name, steps)`) and the held-out losses (`scores`) plug into it,
each read when a retention runs (on the I/O thread, the replica's thread). Pure apart from those callables;
reads and writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Policy:
    keep_last: int
    keep_every: int = 0
    keep_best: int = 0


def best(steps: Iterable[int], scores: Mapping[int, float], k: int) -> set[int]:
    """The `k` steps of `steps` with the lowest held-out loss (ties: the older first); steps without a score
    are no candidates."""
    scored = sorted((scores[s], s) for s in set(steps) if s in scores and scores[s] == scores[s])  # NaN: none
    return {s for _, s in scored[:max(k, 0)]}


def kept_for_good(steps: Iterable[int], policy: Policy, spared: Iterable[int] = (),
                  scores: Mapping[int, float] | None = None) -> set[int]:
    """The steps of `steps` the policy keeps whatever comes later: milestones, the best, the spared."""
    steps = set(steps)
    every = policy.keep_every
    return ({s for s in steps if every and s % every == 0} | (set(spared) & steps)
            | best(steps, scores or {}, policy.keep_best))


def victims(steps: Iterable[int], policy: Policy, spared: Iterable[int] = (),
            scores: Mapping[int, float] | None = None) -> list[int]:
    """The steps to delete, oldest first: all but the newest `keep_last` and those kept for good."""
    ordered = sorted(set(steps))
    recent = set(ordered[-policy.keep_last:]) if policy.keep_last > 0 else set()
    keep = recent | kept_for_good(ordered, policy, spared, scores)
    return [s for s in ordered if s not in keep]


@dataclass
class Retention:
    """The run's policy with the parts that spare steps and the held-out losses, read at each retention."""

    policy: Policy
    scores: Callable[[], Mapping[int, float]] = dict
    _spares: dict[str, Callable[[], Iterable[int]]] = field(default_factory=dict)

    @classmethod
    def of(cls, cfg, scores: Callable[[], Mapping[int, float]] = dict) -> Retention:
        """From `[checkpoint]` (keep_last, keep_every, keep_best)."""
        return cls(Policy(cfg.keep_last, cfg.keep_every, getattr(cfg, "keep_best", 0)), scores)

    def spare(self, name: str, steps: Callable[[], Iterable[int]]) -> None:
        """Add a part that spares steps (once per name: a second one under the same name is a wiring error)."""
        if name in self._spares:
            raise ValueError(f"retention: {name!r} already spares steps")
        self._spares[name] = steps

    def spared(self) -> set[int]:
        return {s for steps in list(self._spares.values()) for s in steps()}

    def victims(self, steps: Iterable[int], also: Iterable[int] = ()) -> list[int]:
        """The steps of `steps` to delete now, sparing `also` besides the parts' steps."""
        return victims(steps, self.policy, self.spared() | set(also), self.scores())

    def kept_for_good(self, steps: Iterable[int], also: Iterable[int] = ()) -> set[int]:
        return kept_for_good(steps, self.policy, self.spared() | set(also), self.scores())
