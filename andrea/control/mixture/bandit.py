"""The data-mixture bandit (docs/formats.md): pure logic over plain data; its only I/O is a JSON-able dict.

Reads per-sequence training losses (`observe`), writes a sampling distribution over the arms
(`probabilities`, `allocate`) and its own state (`to_state` / `from_state`, the `.state.json` payload that the
data proxy stores). Deterministic: no global RNG; `allocate` draws only from the generator it is given.

The objective (`policy.target`, weights t summing to 1): the held-out loss Σ t_i·L_i. The bandit climbs it.

Algorithm: EXP3.S (Graves, Bellemare, Menick, Munos and Kavukcuoglu, "Automated Curriculum Learning for Neural
Networks", ICML 2017) with the reward of Online Data Mixing's kind (Albalak et al., 2023: the reward serves the
loss being minimised) but measured as the objective's gain per sample. Kept from the paper: log-weights w, policy
(1-γ)·softmax(w) + γ/K, the fixed-share mixing of EXP3.S (it bounds how far an arm can fall behind, so an arm
that becomes useful late in a 200K-step run can win again), and rewards rescaled to [-1, 1] by the 20th/80th
percentiles of the history of unscaled rewards. Choices, and why:
- Reward: target gain per unit of share. For each arm i seen in a window, its progress d_i = (loss EMA before
  the window) − (mean loss in the window), in nats, from losses the training step already computed (no second
  forward pass). The raw reward is K·t_i·d_i / n_i, with n_i the arm's realised share of the window's sequences:
  the objective's decrease that arm i's own data bought, per sequence spent on it, i.e. the gradient of
  Σ t_j·L_j in the share p_i when an arm's data lowers mainly its own loss. Plain progress d_i (the previous
  reward, after Matiisen et al., 2017) grows with the share itself, so the arm with the steepest curve took ever
  more (64 % `stdlib-code`, worse than uniform); dividing by the share removes that feedback (an arm whose
  progress comes from training on the others scores low once it is sampled a lot) and the target weight
  removes the pull of what the operator does not ask for: unlearnable noise, or an arm of weight 0, gains
  nothing per sample and sinks to its exploration share and its floor. Help to other arms is not identified
  from training losses at this lag (a window's gains on arm j cannot be told apart by the arm that caused them),
  so an arm of weight 0 is credited with none beyond what exploration gives it.
- Start at the objective. The weights start at log(t_i + γ/K): before any evidence the mixture is the target's
  own (uniform for the default target), so the bandit departs from uniform only on evidence.
- Batches, not single pulls. Every arm sampled in a window gets its own reward at once, so there is no 1/π
  importance weight beyond the share in the reward; an arm not sampled in a window gets no update.
- Caps and floors. The operator's bounds are applied by Euclidean projection of the policy onto the capped
  simplex {x : Σx = 1, lo ≤ x ≤ hi} (andrea/control/mixture/policy.py); the weights learn unconstrained, what is sampled always
  obeys the bounds.
- Reward history. A bounded FIFO of the most recent unscaled rewards rather than the whole history
  (deterministic, needs no sampling RNG, and follows the shrinking loss scale of a long run).
- Weights are mean-centred after each update (softmax is shift-invariant), so the numbers stay small in
  `.state.json` and a new arm entering at the mean weight starts at the geometric-mean share.
"""

from __future__ import annotations

import math

import numpy as np

from andrea.errors import UserError
from andrea.control.mixture.policy import Policy, PolicyError, project_capped_simplex

STATE_FORMAT = 2
"""2: rewards serve `policy.target` (gain per share; the weights start at the target); 1 (self-progress rewards)
is read as a reset, like a pivot: its weights learned another objective."""
LOSS_EMA_HORIZON_STEPS = 50.0
"""Time constant of an arm's loss EMA in steps: five windows, long enough to average out per-window noise, short
enough that the progress it measures is recent (a longer lag makes the mixture overshoot a curve that is
already flattening: in bench/mixture.py's and the tests' simulated worlds 100 steps cost more than 50)."""
REWARD_EMA_DECAY = 0.9
"""Per update; the reward EMA is reported in `.state.json` and does not drive the weights."""
LEAK = 0.1
"""Per update: share of the weights' distance from the start forgotten (a memory of ~1/LEAK = 10 updates), so
the mixture follows the current gains of a diminishing-returns objective, not the sum of past ones (EXP3's
cumulative weights kept chasing an arm whose curve had flattened); the weights stay within η/LEAK (= 1 for the
defaults) of the start, the target's mixture: a bounded bet away from it, taken only on evidence."""
HISTORY_LEN = 1000
"""Unscaled rewards kept for the 20th/80th percentile rescaling."""
FIXED_SHARE = 1e-3
"""EXP3.S α: each update moves this share of the other arms' weight onto every arm, so no log-weight falls more
than ~log((K-1)/α) below the rest (≈ 7.6 for K = 3) and recovery takes tens of updates, not thousands."""


class BanditStateError(UserError, ValueError):
    """A `.state.json` payload that is not a bandit state; the message is one line naming the bad field."""


def systematic_counts(p: np.ndarray, n: int, u: float) -> np.ndarray:
    """Per-arm counts for n draws from p, each floor(p·n) or ceil(p·n), summing to n; u in [0, 1) is the offset.

    floor(p·n) each, then the r leftover draws go to r distinct arms chosen by systematic sampling on the
    fractional parts (each arm is picked with probability equal to its fraction), so E[count] = p·n.
    """
    scaled = p * n
    counts = np.floor(scaled).astype(np.int64)
    frac = scaled - counts
    r = n - int(counts.sum())
    if r > 0:
        picks = np.searchsorted(np.cumsum(frac), u + np.arange(r), side="right")
        chosen = [i for i in dict.fromkeys(picks.tolist()) if i < p.size and frac[i] > 0.0]
        if len(chosen) < r:  # rounding at the end of the cumulative sum; largest fractions fill the gap
            rest = [i for i in np.argsort(-frac, kind="stable").tolist() if frac[i] > 0.0 and i not in chosen]
            chosen += rest[: r - len(chosen)]
        counts[chosen] += 1
    return counts


class Bandit:
    """Discounted EXP3.S over the configured arms, rewards serving the target, bounded by the caps and floors.

    The per-arm arrays (weights, pulls, loss_ema, ...) are public for logging; treat them as read-only, since
    `probabilities()` is cached until the next `update()`.
    """

    def __init__(self, arms: list[str], policy: Policy, *, eta: float, gamma: float, update_every: int,
                 alpha: float = FIXED_SHARE) -> None:
        if tuple(arms) != policy.arms:
            raise PolicyError(f"bandit arms {list(arms)} differ from the policy's {list(policy.arms)}")
        if not (math.isfinite(eta) and eta > 0.0):
            raise PolicyError(f"policy.eta={eta!r} must be > 0")
        if not 0.0 <= gamma <= 1.0:
            raise PolicyError(f"policy.gamma={gamma!r} must be in [0, 1]")
        if isinstance(update_every, bool) or not isinstance(update_every, int) or update_every < 1:
            raise PolicyError(f"policy.update_every={update_every!r} must be an integer >= 1")
        if not 0.0 <= alpha < 1.0:
            raise PolicyError(f"fixed-share alpha={alpha!r} must be in [0, 1)")
        self.arms, self.policy = tuple(arms), policy
        self.eta, self.gamma, self.update_every, self.alpha = float(eta), float(gamma), update_every, float(alpha)
        self._lo, self._hi = policy.bounds()
        k = len(self.arms)
        self.target = policy.target_weights()
        self.weights = self._start_weights()
        self.pulls = np.zeros(k, dtype=np.int64)
        self.loss_ema = np.full(k, np.nan)  # NaN until the arm's first window: no progress without a baseline
        self.reward_ema = np.zeros(k)
        self.window_sum = np.zeros(k)
        self.window_count = np.zeros(k, dtype=np.int64)
        self.reward_history: list[float] = []
        self.updates = 0
        self._probs: np.ndarray | None = None

    def _start_weights(self) -> np.ndarray:
        """log(t + γ/K), mean-centred: softmax of it is the target nudged off zero (every arm gets a weight)."""
        w = np.log(self.target + max(self.gamma, 1e-3) / self.target.size)
        return w - w.mean()

    def target_loss(self) -> float | None:
        """The objective on training losses: Σ t_i·loss EMA_i over the arms with an EMA (None before any)."""
        known = ~np.isnan(self.loss_ema) & (self.target > 0)
        if not known.any():
            return None
        return float(np.sum(self.target[known] * self.loss_ema[known]) / np.sum(self.target[known]))

    def probabilities(self) -> np.ndarray:
        """The realized sampling distribution: (1-γ)·softmax(w) + γ/K projected onto the caps/floors simplex."""
        if self._probs is None:
            e = np.exp(self.weights - self.weights.max())
            mixed = (1.0 - self.gamma) * (e / e.sum()) + self.gamma / e.size
            self._probs = project_capped_simplex(mixed, self._lo, self._hi)
        return self._probs.copy()

    def allocate(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """Arm index for each of n sequences: counts floor/ceil of p·n, order shuffled. Draws u, then a permutation."""
        if n < 0:
            raise ValueError(f"allocate: n={n} must be >= 0")
        counts = systematic_counts(self.probabilities(), n, float(rng.random()))
        return rng.permutation(np.repeat(np.arange(len(self.arms), dtype=np.int64), counts))

    def observe(self, arm_ids: np.ndarray, losses: np.ndarray) -> None:
        """Buffer one step's per-sequence mean losses. Non-finite losses are left out: one inf must not poison w."""
        arm_ids, losses = np.asarray(arm_ids), np.asarray(losses, dtype=np.float64)
        if arm_ids.shape != losses.shape or arm_ids.ndim != 1:
            raise ValueError(f"observe: arm_ids {arm_ids.shape} and losses {losses.shape} must be equal 1-D shapes")
        if arm_ids.size and (arm_ids.dtype.kind not in "iu" or arm_ids.min() < 0 or arm_ids.max() >= len(self.arms)):
            raise ValueError(f"observe: arm ids must be integers in [0, {len(self.arms)})")
        ok = np.isfinite(losses)
        k = len(self.arms)
        self.window_sum += np.bincount(arm_ids[ok], weights=losses[ok], minlength=k)
        self.window_count += np.bincount(arm_ids[ok], minlength=k)

    def update(self) -> dict[str, float]:
        """Learn from the buffered window; returns the rescaled reward of each rewarded arm (for logging)."""
        seen = self.window_count > 0
        if not seen.any():
            return {}
        mean = np.where(seen, self.window_sum / np.maximum(self.window_count, 1), np.nan)
        rewarded = seen & ~np.isnan(self.loss_ema)
        progress = self.loss_ema - mean  # nats: how far the window beat the arm's own running average
        share = self.window_count / self.window_count.sum()  # realised share of the window's sequences
        # The objective's gain per unit of share (module docstring); K·t_i = 1 for the default target.
        raw = np.where(seen, self.target.size * self.target * progress / np.maximum(share, 1e-12), np.nan)
        decay = math.exp(-self.update_every / LOSS_EMA_HORIZON_STEPS)
        baseline = np.where(np.isnan(self.loss_ema), mean, self.loss_ema)  # an arm's first window starts its EMA
        self.loss_ema = np.where(seen, decay * baseline + (1.0 - decay) * mean, self.loss_ema)
        reward = np.zeros(len(self.arms))
        if rewarded.any():
            self.reward_history = (self.reward_history + [float(r) for r in raw[rewarded]])[-HISTORY_LEN:]
            q_lo, q_hi = np.percentile(self.reward_history, [20.0, 80.0])
            if q_hi > q_lo:
                scaled = np.clip(2.0 * (raw - q_lo) / (q_hi - q_lo) - 1.0, -1.0, 1.0)
            else:
                scaled = np.sign(raw - q_lo)
            reward = np.where(rewarded, scaled, 0.0)
            self._exp3s_step(reward)
            self.reward_ema = np.where(rewarded, REWARD_EMA_DECAY * self.reward_ema
                                       + (1.0 - REWARD_EMA_DECAY) * reward, self.reward_ema)
        self.pulls += self.window_count
        self.window_sum = np.zeros(len(self.arms))
        self.window_count = np.zeros(len(self.arms), dtype=np.int64)
        self.updates += 1
        return {a: float(r) for a, r, ok in zip(self.arms, reward, rewarded) if ok}

    def _exp3s_step(self, reward: np.ndarray) -> None:
        start = self._start_weights()
        # Discounted: the weights forget old rewards towards the start (the target's mixture) at rate LEAK, so
        # they follow the current gains of a diminishing-returns objective instead of the sum of past ones.
        v = start + (1.0 - LEAK) * (self.weights - start) + self.eta * reward
        k = v.size
        if k > 1 and self.alpha > 0.0:
            top = v.max()
            e = np.exp(v - top)
            # EXP3.S fixed share, in the log domain: w_i = log((1-α)e^v_i + α/(K-1)·Σ_{j≠i} e^v_j)
            v = np.log((1.0 - self.alpha) * e + self.alpha / (k - 1) * (e.sum() - e)) + top
        self.weights = v - v.mean()
        self._probs = None

    def to_state(self) -> dict:
        """The `.state.json` payload. Floats are Python floats, never rounded (json writes repr: exact round trip).

        {"format": 2, "policy_fingerprint": str, "updates": int, "reward_history": [float, ...] (oldest first),
         "target_loss": float | null (Σ t·loss EMA: the objective on training losses; informational),
         "arms": {name: {"weight", "pulls", "loss_ema" (null before the arm's first window), "reward_ema",
                         "window_loss_sum", "window_count", "share", "target" (the last two informational:
                         not read back; the target comes from the configuration)}}}
        """
        share = self.probabilities()
        return {
            "format": STATE_FORMAT,
            "policy_fingerprint": self.policy.fingerprint(),
            "updates": self.updates,
            "reward_history": list(self.reward_history),
            "target_loss": self.target_loss(),
            "arms": {a: {"weight": float(self.weights[i]), "pulls": int(self.pulls[i]),
                         "loss_ema": None if np.isnan(self.loss_ema[i]) else float(self.loss_ema[i]),
                         "reward_ema": float(self.reward_ema[i]), "window_loss_sum": float(self.window_sum[i]),
                         "window_count": int(self.window_count[i]), "share": float(share[i]),
                         "target": float(self.target[i])}
                     for i, a in enumerate(self.arms)},
        }

    @classmethod
    def from_state(cls, d: object, arms: list[str], policy: Policy, **knobs) -> tuple[Bandit, list[str]]:
        """Resume from `to_state()` output, validated against the current arms and policy; returns (bandit, warnings).

        Zombie arms (in the state, not configured: docs/formats.md) are dropped, new arms start fresh at the mean
        weight, and a state learned under another policy fingerprint gives a fresh bandit (a pivot is a new policy).
        A state of an older format (1: self-progress rewards) is reset the same way, with one warning.
        Raises BanditStateError for anything that is not a well-formed state.
        """
        if is_old_format(d):
            return cls(arms, policy, **knobs), [
                f"bandit state has format {d['format']}, this andrea writes format {STATE_FORMAT} (rewards that "
                f"serve policy.target): starting a fresh bandit, as at a pivot"]
        fingerprint, updates, history, saved = _parse_state(d)
        bandit = cls(arms, policy, **knobs)
        if fingerprint != policy.fingerprint():
            return bandit, [f"bandit state was learned under policy {fingerprint}, the current policy is "
                            f"{policy.fingerprint()}: starting a fresh bandit (new caps/floors are a new policy)"]
        warnings = [f"dropping zombie arm {a!r} from .state.json (not a configured source)"
                    for a in saved if a not in bandit.arms]
        warnings += [f"arm {a!r} is not in .state.json: it starts fresh" for a in bandit.arms if a not in saved]
        bandit.updates, bandit.reward_history = updates, history[-HISTORY_LEN:]
        for i, a in enumerate(bandit.arms):
            if a in saved:
                s = saved[a]
                bandit.weights[i], bandit.pulls[i], bandit.reward_ema[i] = s["weight"], s["pulls"], s["reward_ema"]
                bandit.loss_ema[i] = np.nan if s["loss_ema"] is None else s["loss_ema"]
                bandit.window_sum[i], bandit.window_count[i] = s["window_loss_sum"], s["window_count"]
        bandit._probs = None
        if warnings:  # the arm set changed: new arms enter at the survivors' mean weight, then re-centre
            known = np.array([a in saved for a in bandit.arms])
            if known.any():
                bandit.weights[~known] = bandit.weights[known].mean()
            bandit.weights -= bandit.weights.mean()
        return bandit, warnings


def is_old_format(d: object) -> bool:
    """A state written by an older andrea (format 1): readable as a reset, not as a state."""
    return isinstance(d, dict) and type(d.get("format")) is int and 1 <= d["format"] < STATE_FORMAT


def _parse_state(d: object) -> tuple[str, int, list[float], dict[str, dict]]:
    if not isinstance(d, dict):
        raise BanditStateError(f"bandit state must be a JSON object, got {type(d).__name__}")
    for key in ("format", "policy_fingerprint", "updates", "reward_history", "arms"):
        if key not in d:
            raise BanditStateError(f"bandit state: missing key {key!r}")
    if d["format"] != STATE_FORMAT or isinstance(d["format"], bool):
        raise BanditStateError(f"bandit state: format={d['format']!r}, this andrea reads format {STATE_FORMAT}")
    if not isinstance(d["policy_fingerprint"], str):
        raise BanditStateError("bandit state: policy_fingerprint must be a string")
    updates = _count(d["updates"], "updates")
    if not isinstance(d["reward_history"], list):
        raise BanditStateError("bandit state: reward_history must be a list")
    history = [_finite(r, f"reward_history[{i}]") for i, r in enumerate(d["reward_history"])]
    if not isinstance(d["arms"], dict):
        raise BanditStateError("bandit state: arms must be an object keyed by arm name")
    saved = {}
    for name, s in d["arms"].items():
        where = f"arms[{name!r}]"
        if not isinstance(s, dict):
            raise BanditStateError(f"bandit state: {where} must be an object")
        for key in ("weight", "pulls", "loss_ema", "reward_ema", "window_loss_sum", "window_count"):
            if key not in s:
                raise BanditStateError(f"bandit state: {where} is missing {key!r}")
        saved[name] = {
            "weight": _finite(s["weight"], f"{where}.weight"), "pulls": _count(s["pulls"], f"{where}.pulls"),
            "loss_ema": None if s["loss_ema"] is None else _finite(s["loss_ema"], f"{where}.loss_ema"),
            "reward_ema": _finite(s["reward_ema"], f"{where}.reward_ema"),
            "window_loss_sum": _finite(s["window_loss_sum"], f"{where}.window_loss_sum"),
            "window_count": _count(s["window_count"], f"{where}.window_count"),
        }
    return d["policy_fingerprint"], updates, history, saved


def _finite(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BanditStateError(f"bandit state: {where} must be a finite number, got {value!r}")
    return float(value)


def _count(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise BanditStateError(f"bandit state: {where} must be a non-negative integer, got {value!r}")
    return value
