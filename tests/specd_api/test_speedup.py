"""The speedup model on numbers that can be checked by hand, and its totality on any input."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specd_api.speedup import best_k, ratio, speedup_curve, verify_at, wilson_interval

FLAT = [1.0] * 17  # v(n) = 1: the GPU-at-batch-1 ideal
CPU_FP32 = [0.98 / 0.98, 1.36 / 0.98, 1.68 / 0.98, 1.55 / 0.98, 1.19 / 0.98]  # measured here, relative to v(0)


def speedup(conditional, proposal, k, c, verify):
    return speedup_curve(conditional, proposal, k, c, verify)[k - 1]


@pytest.mark.parametrize(
    ("conditional", "proposal", "k", "c", "verify", "expected", "why"),
    [
        ([1.0] * 4, [1.0] * 4, 4, 0.0, FLAT, 5.0, "always accepted, free drafting: K + 1 tokens per step"),
        ([0.0] * 4, [1.0] * 4, 4, 0.0, FLAT, 1.0, "never accepted: only the bonus token"),
        ([0.5] * 3, [1.0] * 3, 3, 0.0, FLAT, 1.875, "Leviathan: (1 - 0.5^4) / (1 - 0.5) = 1.875"),
        ([0.5] * 3, [1.0] * 3, 3, 0.25, FLAT, 1.875 / 1.75, "same tokens, drafting costs 3 x 0.25 steps"),
        ([1.0] * 2, [0.5, 0.5], 2, 0.0, FLAT, 2.0, "lookup proposes half the time: E = 1 + 0.5 + 0.5"),
        # v is a table: a round drafting n tokens costs v(n), whatever K was.
        ([1.0] * 4, [1.0] * 4, 4, 0.0, CPU_FP32, 5.0 / CPU_FP32[4], "K = 4 always drafts 4: costs v(4)"),
        ([1.0] * 2, [1.0] * 2, 2, 0.0, CPU_FP32, 3.0 / CPU_FP32[2], "K = 2 costs v(2), dearer than v(4) here"),
        # With a stop rule the draft reaches position 1 in half the rounds: N = 1 or 2, each half the time,
        # E = 1 + 1·1 + 0.5·1 tokens, cost = c·1.5 + (0.5·v(1) + 0.5·v(2)).
        ([1.0] * 2, [1.0, 0.5], 2, 0.1, [1.0, 1.2, 1.6], 2.5 / (0.15 + 0.6 + 0.8), "a shorter draft costs less"),
        # A position cannot be proposed more often than the one before it: pi is cut to the running minimum.
        ([1.0] * 2, [0.5, 1.0], 2, 0.0, FLAT, 2.0, "pi_1 > pi_0 is treated as pi_1 = pi_0"),
    ],
)  # fmt: skip
def test_expected_speedup(conditional, proposal, k, c, verify, expected, why):
    assert speedup(conditional, proposal, k, c, verify) == pytest.approx(expected), why


def test_the_best_k_can_be_interior():
    # On this CPU's v(n) a 90% draft is best at K = 4, not at the largest K allowed (v grows again past 4).
    verify = [1.0, 1.39, 1.71, 1.58, 1.21, 1.9, 2.3, 2.7, 3.1]
    curve = speedup_curve([0.9] * 8, [1.0] * 8, 8, 0.1, verify)
    assert best_k(curve) == (4, pytest.approx(curve[3]))
    assert curve[3] > curve[7] and curve[3] > curve[1]


def test_best_k_respects_k_min_and_an_empty_curve():
    assert best_k([3.0, 2.0, 1.0], k_min=2) == (2, 2.0)
    assert best_k([]) == (0, 1.0)


def test_verify_beyond_the_table_extends_at_the_slope():
    assert verify_at([1.0, 1.5], 1) == 1.5
    assert verify_at([1.0, 1.5], 3, slope=0.1) == pytest.approx(1.7)
    assert verify_at([], 4, slope=0.02) == pytest.approx(1.08)


@pytest.mark.parametrize(
    "values",
    [
        ([math.nan] * 3, [1.0] * 3, math.nan, [0.0] * 4),
        ([2.0, -1.0, math.inf], [math.inf, -3.0, 1.0], -5.0, [-1.0, math.nan, 0.0]),
        ([], [], 0.0, []),
    ],
)
def test_the_curve_is_total(values):
    conditional, proposal, c, verify = values
    for x in speedup_curve(conditional, proposal, 3, c, verify):
        assert math.isfinite(x) and x >= 0


def reference_curve(conditional, proposal, k_max, c, verify, slope):
    """The speedup of each K written out from the module docstring, one K at a time (quadratic, no shared
    running sums): rates clamped to [0, 1] (not a number: 0), pi cut to the running minimum, c >= 0, v(n) a
    table whose bad entries count as one step and whose end extends at the slope."""

    def rate(values, i):
        x = float(values[i]) if i < len(values) else 0.0
        return 0.0 if not math.isfinite(x) else min(max(x, 0.0), 1.0)

    def v(n):
        cost = lambda x: x if math.isfinite(x) and x >= 0 else 1.0  # noqa: E731
        if not verify:
            return cost(1.0 + slope * n)
        return (
            cost(float(verify[n])) if n < len(verify) else cost(float(verify[-1])) + cost(slope) * (n - len(verify) + 1)
        )

    c = max(c, 0.0) if math.isfinite(c) else 0.0
    pi = []
    for i in range(k_max):
        pi.append(min(rate(proposal, i), pi[-1] if pi else 1.0))
    curve = []
    for k in range(1, k_max + 1):
        tokens = 1.0 + sum(pi[i] * math.prod(rate(conditional, j) for j in range(i + 1)) for i in range(k))
        reach = [1.0, *pi[:k], 0.0]  # P(N >= n) for n = 0..k+1
        cost = c * sum(pi[:k]) + sum((reach[n] - reach[n + 1]) * v(n) for n in range(k + 1))
        curve.append(tokens / max(cost, 1e-9))
    return curve


RATE = st.one_of(st.floats(0.0, 1.0), st.sampled_from([math.nan, math.inf, -math.inf, -0.5, 1.5, -0.0]))
COST = st.one_of(st.floats(0.0, 4.0), st.sampled_from([math.nan, math.inf, -1.0, 0.0]))


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.floats(0.0, 1.0), max_size=20) | st.lists(RATE, max_size=20),
    st.lists(st.floats(0.0, 1.0), max_size=20) | st.lists(RATE, max_size=20),
    st.integers(0, 18),
    COST,
    st.lists(COST, max_size=20),
    COST,
)
@example([0.5, math.nan, 0.7], [1.0] * 3, 3, 0.1, [1.0, 1.1], 0.02)  # a rate list in range but for a NaN
@example([0.9] * 4, [1.0, 0.5, math.inf, 0.2], 4, 0.1, [], 0.05)
def test_the_curve_is_the_formula_k_by_k(conditional, proposal, k_max, c, verify, slope):
    curve = speedup_curve(conditional, proposal, k_max, c, verify, slope)
    expected = reference_curve(conditional, proposal, k_max, c, verify, slope)
    assert curve == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize(("successes", "trials"), [(50, 100), (0, 10), (10, 10), (3.5, 7.25)])
def test_wilson_interval_contains_the_rate(successes, trials):
    low, high = wilson_interval(successes, trials)
    assert 0.0 <= low <= successes / trials <= high <= 1.0


def test_wilson_interval_narrows_with_data_and_is_total():
    width = [wilson_interval(500, 1000), wilson_interval(5, 10)]
    assert width[0][1] - width[0][0] < width[1][1] - width[1][0]
    assert wilson_interval(1, 0) == wilson_interval(1, math.nan) == (0.0, 1.0)


def test_ratio_never_fails():
    assert ratio(1, 2) == 0.5
    assert ratio(1, 0) == 0.0 and ratio(math.inf, 1, default=-1) == -1 and ratio(1e308, 1e-308, 7) == 7
