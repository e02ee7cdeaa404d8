"""Tests for andrea/control/mixture/bandit.py: policy validation, the capped-simplex projection (against a brute-force
active-set solver), caps/floors under random learning, learning on a synthetic curriculum, and `.state.json`
round trips (bit-exact resume, zombie arms, pivots, garbage). Pure CPU, no files."""

from __future__ import annotations

import itertools
import json
import math
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from andrea.control.mixture.bandit import FIXED_SHARE, Bandit, BanditStateError, systematic_counts
from andrea.control.mixture.policy import PolicyError, project_capped_simplex, validate_policy

KNOBS = dict(eta=0.1, gamma=0.05, update_every=10)
FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def feasible_policies(draw):
    """(arms, caps, floors) with Σfloors ≤ 1 ≤ Σcaps, some bounds omitted, boundary values reachable."""
    k = draw(st.integers(1, 6))
    arms = [f"arm{i}" for i in range(k)]
    floors, caps = {}, {}
    for a in arms:
        if draw(st.booleans()):
            floors[a] = draw(st.floats(0.0, 1.0 / k))
        if draw(st.booleans()):
            caps[a] = draw(st.floats(floors.get(a, 0.0), 1.0))
    if math.fsum(caps.get(a, 1.0) for a in arms) < 1.0:
        caps[arms[draw(st.integers(0, k - 1))]] = 1.0
    return arms, caps, floors


def check_distribution(p, lo, hi):
    assert np.all(p >= lo) and np.all(p <= hi), (p, lo, hi)  # exact: no tolerance on the bounds
    assert abs(p.sum() - 1.0) <= 1e-12


def check_counts(ids, p, n):
    counts = np.bincount(ids, minlength=p.size)
    assert counts.sum() == n == ids.size
    for c, x in zip(counts, p * n):
        assert c in (math.floor(x), math.ceil(x)), (counts, p * n)


def drive(bandit, rng, steps, loss_of):
    """Train-loop stand-in: allocate, observe losses from `loss_of(step, ids, rng)`, update on the cadence."""
    for step in range(steps):
        ids = bandit.allocate(16, rng)
        bandit.observe(ids, loss_of(step, ids, rng))
        if (step + 1) % bandit.update_every == 0:
            bandit.update()


# --- policy validation --------------------------------------------------------------------------------------

@pytest.mark.parametrize("caps, floors, needle", [
    ({"zzz": 0.5}, {}, "unknown arm 'zzz'"),
    ({}, {"zzz": 0.1}, "unknown arm 'zzz'"),
    ({"a": 1.5}, {}, "policy.caps['a']=1.5"),
    ({}, {"a": -0.1}, "policy.floors['a']=-0.1"),
    ({"a": float("nan")}, {}, "policy.caps['a']=nan"),
    ({"a": True}, {}, "policy.caps['a']=True"),
    ({"a": "0.5"}, {}, "policy.caps['a']='0.5'"),
    ({"a": 0.2}, {"a": 0.3}, "cap 0.2 below its floor 0.3"),
    ({}, {"a": 0.5, "b": 0.4, "c": 0.2}, "floors sum to"),
    ({"a": 0.3, "b": 0.3, "c": 0.3}, {}, "caps sum to"),
])
def test_validate_policy_refuses_with_one_line(caps, floors, needle):
    with pytest.raises(PolicyError) as e:
        validate_policy(["a", "b", "c"], caps, floors)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_validate_policy_accepts_decimal_sums_of_one():
    policy = validate_policy(["a", "b", "c"], {"a": 0.1, "b": 0.2, "c": 0.7}, {"a": 0.1, "b": 0.2, "c": 0.7})
    assert policy.lo == policy.hi == (0.1, 0.2, 0.7)
    assert np.array_equal(Bandit(["a", "b", "c"], policy, **KNOBS).probabilities(), [0.1, 0.2, 0.7])


@st.composite
def infeasible_policies(draw):
    arms = ["a", "b", "c"]
    kind = draw(st.sampled_from(["unknown", "range", "cap<floor", "floors>1", "caps<1"]))
    if kind == "unknown":
        return arms, {draw(st.text(min_size=1).filter(lambda s: s not in arms)): 0.5}, {}
    if kind == "range":
        bad = draw(st.one_of(st.floats().filter(lambda x: not 0.0 <= x <= 1.0), st.booleans(), st.text()))
        return arms, {draw(st.sampled_from(arms)): bad}, {}
    if kind == "cap<floor":
        floor = draw(st.floats(1e-9, 1.0))
        return arms, {"a": draw(st.floats(0.0, floor, exclude_max=True))}, {"a": floor}
    if kind == "floors>1":
        floors = {a: draw(st.floats(0.0, 1.0)) for a in arms}
        assume(math.fsum(floors.values()) > 1.0)
        return arms, {}, floors
    caps = {a: draw(st.floats(0.0, 1.0)) for a in arms}
    assume(math.fsum(caps.values()) < 1.0)
    return arms, caps, {}


@FAST
@given(infeasible_policies())
def test_random_infeasible_policies_are_refused(case):
    arms, caps, floors = case
    with pytest.raises(PolicyError) as e:
        validate_policy(arms, caps, floors)
    assert "\n" not in str(e.value)


def test_fingerprint_tracks_bounds_not_order_nor_unbounded_arms():
    base = validate_policy(["a", "b", "c"], {"a": 0.5}, {"b": 0.1}).fingerprint()
    assert validate_policy(["c", "b", "a"], {"a": 0.5}, {"b": 0.1}).fingerprint() == base
    assert validate_policy(["a", "b", "d"], {"a": 0.5}, {"b": 0.1}).fingerprint() == base  # unbounded arm swapped
    assert validate_policy(["a", "b", "c"], {"a": 0.5, "c": 1}, {"b": 0.1, "c": 0}).fingerprint() == base
    assert validate_policy(["a", "b", "c"], {"a": 0.6}, {"b": 0.1}).fingerprint() != base
    assert validate_policy(["a", "b", "c"], {"a": 0.5}, {"c": 0.1}).fingerprint() != base


# --- the projection ------------------------------------------------------------------------------------------

def brute_force_projection(p, lo, hi):
    """Try every active set (each coordinate at lo, at hi, or free at p − τ); keep the nearest feasible point.

    Feasible means inside the bounds exactly, as the projection must be: a tolerance there would let the oracle
    pick a point just outside a tiny floor (x = 0 under lo = 1e-12) that is nearer than any feasible one.
    A free coordinate that rounds past its bound is no loss: the active set with it on that bound gives the point."""
    best = None
    for assign in itertools.product((0, 1, 2), repeat=p.size):
        assign = np.array(assign)
        x = np.where(assign == 0, lo, np.where(assign == 1, hi, 0.0))
        free = assign == 2
        if free.any():
            x[free] = p[free] - (p[free].sum() - (1.0 - x[~free].sum())) / free.sum()
        if np.all(x >= lo) and np.all(x <= hi) and abs(x.sum() - 1.0) <= 1e-12:
            d = float(((x - p) ** 2).sum())
            if best is None or d < best[0]:
                best = (d, x)
    return best


@FAST
@given(feasible_policies().filter(lambda c: len(c[0]) <= 4), st.data())
def test_projection_is_the_euclidean_projection(case, data):
    arms, caps, floors = case
    lo, hi = validate_policy(arms, caps, floors).bounds()
    p = np.array(data.draw(st.lists(st.floats(-3.0, 3.0), min_size=len(arms), max_size=len(arms))))
    x = project_capped_simplex(p, lo, hi)
    check_distribution(x, lo, hi)
    d_best, x_best = brute_force_projection(p, lo, hi)
    d = float(((x - p) ** 2).sum())
    assert d <= d_best + 1e-12
    # For a projection onto a convex set, |x − x*|² ≤ d(x) − d(x*): equal distances mean the same point.
    assert np.allclose(x, x_best, atol=1e-6, rtol=0)
    # KKT: one shift τ explains every coordinate (free at p − τ, on lo only if p − τ ≤ lo, on hi if ≥ hi);
    # an arm with lo == hi is fixed and says nothing about τ.
    movable = lo < hi
    at_lo, at_hi = movable & (x == lo), movable & (x == hi)
    free = movable & ~at_lo & ~at_hi
    if free.any():
        tau = float(np.mean(p[free] - x[free]))
        assert np.allclose(p[free] - x[free], tau, atol=1e-9)
        assert np.all(p[at_lo] - tau <= lo[at_lo] + 1e-9)
        assert np.all(p[at_hi] - tau >= hi[at_hi] - 1e-9)


def test_projection_near_a_tiny_floor_matches_the_exact_oracle():
    # Found by hypothesis: an oracle with a 1e-12 slack on the bounds preferred x = (1, 0), just under the floor.
    lo, hi = validate_policy(["a", "b"], {}, {"b": 1e-12}).bounds()
    p = np.array([2.0, 0.0])
    x = project_capped_simplex(p, lo, hi)
    check_distribution(x, lo, hi)
    d_best, x_best = brute_force_projection(p, lo, hi)
    assert x_best[1] == 1e-12 and float(((x - p) ** 2).sum()) <= d_best + 1e-12


def test_projection_keeps_a_feasible_point_and_handles_tight_bounds():
    lo, hi = np.array([0.1, 0.0, 0.2]), np.array([0.5, 1.0, 0.2])
    p = np.array([0.3, 0.5, 0.2])
    assert np.allclose(project_capped_simplex(p, lo, hi), p, atol=1e-15)
    x = project_capped_simplex(np.array([1e6, -1e6, 0.0]), lo, hi)
    check_distribution(x, lo, hi)
    assert np.allclose(x, [0.5, 0.3, 0.2], atol=1e-12)
    with pytest.raises(ValueError):
        project_capped_simplex(p, lo, np.array([0.5, 0.2, 0.2]))  # caps sum below 1


def test_systematic_counts_are_unbiased():
    p, n = np.array([0.123, 0.377, 0.5]), 7
    us = (np.arange(4000) + 0.5) / 4000
    mean = np.mean([systematic_counts(p, n, u) for u in us], axis=0)
    assert np.allclose(mean, p * n, atol=1e-3)


# --- caps and floors under learning -----------------------------------------------------------------------------

@FAST
@given(feasible_policies(), st.floats(0.01, 20.0), st.floats(0.0, 1.0), st.integers(1, 5), st.integers(0, 2**32 - 1),
       st.lists(st.integers(0, 64), min_size=1, max_size=10))
def test_probabilities_and_allocations_respect_the_policy(case, eta, gamma, update_every, seed, batch_sizes):
    arms, caps, floors = case
    policy = validate_policy(arms, caps, floors)
    lo, hi = policy.bounds()
    bandit = Bandit(arms, policy, eta=eta, gamma=gamma, update_every=update_every)
    rng = np.random.default_rng(seed)
    scales = rng.exponential(1.0, size=len(arms)) * 10.0 ** rng.integers(-3, 3, size=len(arms))
    for step, n in enumerate(batch_sizes):
        p = bandit.probabilities()
        check_distribution(p, lo, hi)
        ids = bandit.allocate(n, rng)
        check_counts(ids, p, n)
        bandit.observe(ids, scales[ids] * rng.random(n) + rng.normal(0.0, 5.0) * (ids == step % len(arms)))
        if (step + 1) % update_every == 0:
            bandit.update()
    check_distribution(bandit.probabilities(), lo, hi)


def test_allocate_is_a_pure_function_of_state_and_rng():
    bandit = Bandit(["a", "b", "c"], validate_policy(["a", "b", "c"], {}, {}), **KNOBS)
    bandit.weights[:] = [1.0, -0.5, -0.5]
    before = bandit.to_state()
    first = bandit.allocate(33, np.random.default_rng(7))
    assert np.array_equal(first, bandit.allocate(33, np.random.default_rng(7)))
    assert bandit.to_state() == before
    assert first.dtype == np.int64 and first.shape == (33,)


# --- learning ----------------------------------------------------------------------------------------------------

ARMS3 = ["easy", "flat_a", "flat_b"]


def curriculum_loss(step, ids, rng):
    """'easy' is learnable (3·exp(-t/200)); the others are flat noise around 2.5."""
    mean = np.where(ids == 0, 3.0 * math.exp(-step / 200.0), 2.5)
    return mean + rng.normal(0.0, 0.1, size=ids.size)


def test_bandit_learns_to_favour_the_learnable_arm_within_floors():
    policy = validate_policy(ARMS3, {}, {"easy": 0.1, "flat_a": 0.1, "flat_b": 0.1})
    bandit = Bandit(ARMS3, policy, **KNOBS)
    assert np.allclose(bandit.probabilities(), 1 / 3)
    drive(bandit, np.random.default_rng(0), 600, curriculum_loss)  # 60 updates
    p = bandit.probabilities()
    # Threshold: > 0.45 for 'easy' (uniform is 1/3; the weights stay within eta/LEAK = 1 of the start, which
    # allows at most ~0.58), the others held at >= 0.1.
    assert p[0] > 0.45, p
    assert np.all(p[1:] >= 0.1), p
    assert bandit.pulls[0] > 1.2 * max(bandit.pulls[1], bandit.pulls[2])
    assert bandit.updates == 60


def test_fixed_share_lets_a_late_learnable_arm_win_back():
    policy = validate_policy(ARMS3, {}, {})
    bandit = Bandit(ARMS3, policy, **KNOBS)
    rng = np.random.default_rng(1)
    ids = np.repeat(np.arange(3), 20)
    for t in range(2000):  # arm 0 keeps improving for a long time
        bandit.observe(ids, np.where(ids == 0, 5.0 - 0.001 * t, 2.5) + rng.normal(0.0, 0.01, ids.size))
        bandit.update()
    assert np.ptp(bandit.weights) < math.log(2 / FIXED_SHARE) + 1.0  # bounded, not ~ eta·2000
    for t in range(100):  # then arm 1 becomes the learnable one and arm 0 goes flat
        bandit.observe(ids, np.where(ids == 1, 2.5 - 0.01 * t, 3.0) + rng.normal(0.0, 0.01, ids.size))
        bandit.update()
    assert int(np.argmax(bandit.probabilities())) == 1


def test_observe_validates_ids_and_skips_non_finite_losses():
    bandit = Bandit(ARMS3, validate_policy(ARMS3, {}, {}), **KNOBS)
    bandit.observe(np.array([0, 1, 2, 0]), np.array([1.0, np.inf, np.nan, 3.0]))
    assert bandit.window_count.tolist() == [2, 0, 0] and bandit.window_sum[0] == 4.0
    with pytest.raises(ValueError):
        bandit.observe(np.array([0, 3]), np.array([1.0, 1.0]))
    with pytest.raises(ValueError):
        bandit.observe(np.array([0.0]), np.array([1.0]))
    assert bandit.update() == {}  # first window only sets the baselines
    assert bandit.update() == {} and bandit.updates == 1  # an empty window is a no-op


def test_bad_knobs_are_refused():
    policy = validate_policy(ARMS3, {}, {})
    for knobs in (dict(KNOBS, eta=0.0), dict(KNOBS, gamma=1.5), dict(KNOBS, update_every=0)):
        with pytest.raises(PolicyError):
            Bandit(ARMS3, policy, **knobs)
    with pytest.raises(PolicyError):
        Bandit(["easy", "flat_a"], policy, **KNOBS)


# --- state: round trip, zombies, pivots, garbage -----------------------------------------------------------------

def trained(arms, policy, steps=37, seed=3):
    bandit = Bandit(arms, policy, **KNOBS)
    drive(bandit, np.random.default_rng(seed), steps, curriculum_loss)
    return bandit


def test_round_trip_through_json_is_bit_exact():
    policy = validate_policy(ARMS3, {"easy": 0.7}, {"flat_b": 0.05})
    original = trained(ARMS3, policy, steps=137)  # 13 updates and a half-full window pending
    assert original.window_count.sum() > 0
    text = json.dumps(original.to_state())
    resumed, warnings = Bandit.from_state(json.loads(text), ARMS3, policy, **KNOBS)
    assert warnings == []
    assert json.dumps(resumed.to_state()) == text
    assert np.array_equal(resumed.probabilities(), original.probabilities())
    rng_a, rng_b = np.random.default_rng(11), np.random.default_rng(11)
    for step in range(137, 300):
        ids_a, ids_b = original.allocate(16, rng_a), resumed.allocate(16, rng_b)
        assert np.array_equal(ids_a, ids_b)
        losses = curriculum_loss(step, ids_a, np.random.default_rng(step))
        original.observe(ids_a, losses)
        resumed.observe(ids_b, losses)
        if (step + 1) % 10 == 0:
            assert original.update() == resumed.update()
        assert np.array_equal(original.probabilities(), resumed.probabilities())
    assert original.to_state() == resumed.to_state()


def test_zombie_arm_is_dropped_and_new_arm_starts_fresh():
    old_arms = ["easy", "flat_a", "repo-docstrings"]
    state = trained(old_arms, validate_policy(old_arms, {}, {"easy": 0.1}), steps=60).to_state()
    new_arms = ["easy", "flat_a", "flat_b"]
    bandit, warnings = Bandit.from_state(state, new_arms, validate_policy(new_arms, {}, {"easy": 0.1}), **KNOBS)
    assert "dropping zombie arm 'repo-docstrings' from .state.json (not a configured source)" in warnings
    assert any("'flat_b'" in w and "fresh" in w for w in warnings)
    assert "repo-docstrings" not in bandit.to_state()["arms"]
    assert bandit.pulls.tolist()[:2] == [state["arms"]["easy"]["pulls"], state["arms"]["flat_a"]["pulls"]]
    assert bandit.pulls[2] == 0 and np.isnan(bandit.loss_ema[2]) and bandit.reward_ema[2] == 0.0
    assert bandit.updates == state["updates"]
    # The survivors keep their learned difference; the newcomer enters at their mean (geometric-mean share).
    w_old = [state["arms"][a]["weight"] for a in ("easy", "flat_a")]
    assert np.isclose(bandit.weights[0] - bandit.weights[1], w_old[0] - w_old[1], atol=1e-12)
    assert np.isclose(bandit.weights[2], bandit.weights[:2].mean(), atol=1e-12)
    check_distribution(bandit.probabilities(), *bandit.policy.bounds())


def test_policy_change_gives_a_fresh_bandit_with_a_warning():
    state = trained(ARMS3, validate_policy(ARMS3, {"easy": 0.5}, {}), steps=60).to_state()
    pivot = validate_policy(ARMS3, {"easy": 0.4}, {"flat_a": 0.1})
    bandit, warnings = Bandit.from_state(state, ARMS3, pivot, **KNOBS)
    assert len(warnings) == 1 and "fresh bandit" in warnings[0] and state["policy_fingerprint"] in warnings[0]
    assert bandit.to_state() == Bandit(ARMS3, pivot, **KNOBS).to_state()


def _state():
    return json.loads(json.dumps(trained(ARMS3, validate_policy(ARMS3, {}, {}), steps=25).to_state()))


def _set(path, value):
    def mutate(d):
        node = d
        for key in path[:-1]:
            node = node[key]
        if value is KeyError:
            del node[path[-1]]
        else:
            node[path[-1]] = value
        return d
    return mutate


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: None, "JSON object"),
    (lambda d: [d], "JSON object"),
    (_set(["arms"], KeyError), "missing key 'arms'"),
    (_set(["format"], 3), "format=3"),  # a newer andrea's; format 1 is a reset (test below)
    (_set(["policy_fingerprint"], 7), "policy_fingerprint"),
    (_set(["updates"], -1), "updates"),
    (_set(["updates"], True), "updates"),
    (_set(["reward_history"], "1.0"), "reward_history"),
    (_set(["reward_history"], [0.5, "x"]), "reward_history[1]"),
    (_set(["reward_history"], [float("nan")]), "reward_history[0]"),
    (_set(["arms"], ["easy"]), "arms must be an object"),
    (_set(["arms", "easy"], 3), "arms['easy'] must be an object"),
    (_set(["arms", "easy", "weight"], KeyError), "arms['easy'] is missing 'weight'"),
    (_set(["arms", "easy", "weight"], float("nan")), "arms['easy'].weight"),
    (_set(["arms", "easy", "weight"], "1.0"), "arms['easy'].weight"),
    (_set(["arms", "flat_a", "pulls"], 1.5), "arms['flat_a'].pulls"),
    (_set(["arms", "flat_a", "loss_ema"], float("inf")), "arms['flat_a'].loss_ema"),
    (_set(["arms", "flat_b", "window_count"], -3), "arms['flat_b'].window_count"),
])
def test_garbage_state_raises_one_line_naming_the_field(mutate, needle):
    with pytest.raises(BanditStateError) as e:
        Bandit.from_state(mutate(_state()), ARMS3, validate_policy(ARMS3, {}, {}), **KNOBS)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_nan_written_by_json_is_refused():
    text, count = re.subn(r'"reward_ema": [-0-9.e]+', '"reward_ema": NaN', json.dumps(_state()), count=1)
    assert count == 1
    with pytest.raises(BanditStateError, match="reward_ema"):
        Bandit.from_state(json.loads(text), ARMS3, validate_policy(ARMS3, {}, {}), **KNOBS)
