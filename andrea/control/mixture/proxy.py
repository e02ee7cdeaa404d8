"""The data proxy: turns the bandit's mixture into the batch of each step, and keeps the bandit fed.

Reads the prepared token arrays (andrea/data/store.py) and per-sequence losses from the step records; its state
is the `.state.json` sidecar (andrea/rundir/sidecars.py). The batch at step t is a pure function of
(seed, t, bandit state), and the bandit state a pure function of the losses — so resume is bit-identical:

- The mixture changes at window boundaries (every `policy.update_every` = K steps) and lags one window:
  the mixture of window w (steps [wK, (w+1)K)) has learned from every step before (w-1)K. The step in
  flight's losses are therefore never needed to build the next batch, which is prepared while the step runs.
- Observations not yet applied are part of the state, saved beside every checkpoint.
- A pivot (new caps, floors or target) starts a fresh bandit at the pivot step; older observations are dropped.
  So does a state of an older format (bandit.STATE_FORMAT): its weights learned another objective.
The state's `"version"` is its envelope's: 2, sealed by its writer (rundir/sidecars.py's `seal`: a flipped digit of
a reward would change every later batch); states from before seals carry none.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from andrea.config.schema import RunConfig
from andrea.control.mixture.bandit import Bandit, BanditStateError, is_old_format
from andrea.data.store import TRAIN_STREAM, ArmTokens, rng_for, rows
from andrea.control.mixture.policy import Policy, validate_policy

log = logging.getLogger("andrea.proxy")
STATE_VERSION = 2  # the state's envelope: sealed (1, or none: from before seals)


@dataclass
class Batch:
    step: int
    x: torch.Tensor  # (B, T) int64
    y: torch.Tensor  # (B, T) int64
    arm_ids: np.ndarray  # (B,) which arm each row came from


class DataProxy:
    def __init__(self, cfg: RunConfig, arms: list[ArmTokens], *, phase: int = 0, phase_start: int = 0,
                 bandit: Bandit | None = None, applied_upto: int | None = None):
        self.cfg = cfg
        self.arms = arms
        self.names = [a.name for a in arms]
        self.policy: Policy = validate_policy(self.names, cfg.policy.caps, cfg.policy.floors, cfg.policy.target)
        self.every = cfg.policy.update_every
        self.bandit = bandit or self._fresh_bandit()
        self.phase, self.phase_start = phase, phase_start
        self.applied_upto = phase_start if applied_upto is None else applied_upto
        self.unapplied: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # step -> (arm_ids, losses)
        self.issued: dict[int, np.ndarray] = {}  # arm ids of batches handed out and not yet observed
        self.data_offset = 0  # the guard's data skip (control/guard/decisions.py): step t draws the stream key t + offset

    def _fresh_bandit(self) -> Bandit:
        p = self.cfg.policy
        return Bandit(self.names, self.policy, eta=p.eta, gamma=p.gamma, update_every=p.update_every)

    # --- the mixture ---------------------------------------------------------------------------------------
    def cut_for(self, step: int) -> int:
        """Observations of steps below this shape the mixture of `step` (one window of lag)."""
        return max(self.phase_start, (step // self.every - 1) * self.every)

    def advance(self, step: int) -> None:
        """Apply every completed window the mixture of `step` depends on (all must have been observed)."""
        cut = self.cut_for(step)
        while self.applied_upto < cut:
            end = min(cut, (self.applied_upto // self.every + 1) * self.every)
            for s in range(self.applied_upto, end):
                arm_ids, losses = self.unapplied.pop(s)
                self.bandit.observe(arm_ids, losses)
            self.bandit.update()
            self.applied_upto = end

    def batch(self, step: int) -> Batch:
        self.advance(step)
        rng = rng_for(self.cfg.train.seed, step + self.data_offset, TRAIN_STREAM)
        arm_ids = self.bandit.allocate(self.cfg.train.batch_size, rng)
        x, y = rows(self.arms, arm_ids, self.cfg.model.block_size, rng)
        self.issued[step] = arm_ids
        return Batch(step, x, y, arm_ids)

    def observe(self, step: int, seq_losses: np.ndarray) -> None:
        """Per-sequence losses of the update that produced header step `step` (batch step - 1)."""
        batch_step = step - 1
        arm_ids = self.issued.pop(batch_step)
        if batch_step >= self.applied_upto:
            self.unapplied[batch_step] = (arm_ids, seq_losses)

    def shares(self) -> dict[str, float]:
        return dict(zip(self.names, map(float, self.bandit.probabilities())))

    # --- state ---------------------------------------------------------------------------------------------
    def state(self, step: int) -> dict:
        """JSON-able state as of header step `step` (every step below it observed)."""
        pending = sorted(s for s in self.unapplied if s < step)
        return {
            "version": STATE_VERSION,
            "step": step,
            "arms": self.names,
            "phase": self.phase,
            "phase_start": self.phase_start,
            "policy": {"caps": self.cfg.policy.caps, "floors": self.cfg.policy.floors,
                       "target": dict(zip(self.names, map(float, self.policy.target_weights()))),
                       "fingerprint": self.policy.fingerprint()},
            "shares": self.shares(),
            "target_loss": self.bandit.target_loss(),
            "applied_upto": self.applied_upto,
            "pending": {"steps": pending, "arm_ids": [self.unapplied[s][0].tolist() for s in pending],
                        "losses": [self.unapplied[s][1].tolist() for s in pending]},
            "bandit": self.bandit.to_state(),
        }

    @classmethod
    def from_state(cls, cfg: RunConfig, arms: list[ArmTokens], d: object, step: int,
                   source: str) -> tuple["DataProxy", list[str]]:
        """Restore the proxy saved at header step `step`; raise BanditStateError naming `source` and the field."""
        try:
            if not isinstance(d, dict):
                raise BanditStateError("not a JSON object")
            for key, typ in (("step", int), ("arms", list), ("phase", int), ("phase_start", int),
                             ("applied_upto", int), ("pending", dict), ("policy", dict), ("bandit", dict)):
                if not isinstance(d.get(key), typ) or isinstance(d.get(key), bool):
                    raise BanditStateError(f"field {key!r} missing or not {typ.__name__}")
            if d["step"] != step:
                raise BanditStateError(f"field 'step' is {d['step']}, expected {step}")
            proxy = cls(cfg, arms, phase=d["phase"], phase_start=d["phase_start"])
            bandit, warnings = Bandit.from_state(d["bandit"], proxy.names, proxy.policy, eta=cfg.policy.eta,
                                                 gamma=cfg.policy.gamma, update_every=cfg.policy.update_every)
            if is_old_format(d["bandit"]) or d["bandit"].get("policy_fingerprint") != proxy.policy.fingerprint():
                # Learned under another policy (a pivot happened since) or another objective (an older format):
                # a new phase with a fresh bandit (docs/formats.md); the old phase's observations belong to the old one.
                return cls(cfg, arms, phase=d["phase"] + 1, phase_start=step, bandit=bandit), warnings
            proxy.bandit = bandit
            proxy.applied_upto = d["applied_upto"]
            pending = d["pending"]
            if [int(s) for s in pending["steps"]] != list(range(d["applied_upto"], step)):  # another run's
                raise BanditStateError(f"pending steps are not every step from applied_upto {d['applied_upto']} "
                                       f"to {step}")
            remap = {i: proxy.names.index(n) for i, n in enumerate(d["arms"]) if n in proxy.names}
            for s, ids, losses in zip(pending["steps"], pending["arm_ids"], pending["losses"], strict=True):
                keep = [j for j, a in enumerate(ids) if a in remap]
                proxy.unapplied[int(s)] = (np.array([remap[ids[j]] for j in keep], dtype=np.int64),
                                           np.array([float(losses[j]) for j in keep], dtype=np.float64))
            return proxy, warnings
        except (BanditStateError, KeyError, TypeError, ValueError) as e:
            raise BanditStateError(f"{source}: {e}") from None
