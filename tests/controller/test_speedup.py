"""The speedup model on numbers that can be checked by hand."""

from __future__ import annotations

import pytest

from controller.speedup import VerifyCost, expected_speedup, fit_verify_cost, speedup_curve, wilson_interval

FREE_VERIFY = VerifyCost(intercept_seconds=1.0, slope_seconds=0.0)  # v(n) = 1: the GPU-at-batch-1 ideal


@pytest.mark.parametrize(
    ("conditional", "proposal", "k", "c", "expected", "why"),
    [
        ([1.0] * 4, [1.0] * 4, 4, 0.0, 5.0, "always accepted, free drafting: K + 1 tokens per step"),
        ([0.0] * 4, [1.0] * 4, 4, 0.0, 1.0, "never accepted: only the bonus token"),
        ([0.5] * 3, [1.0] * 3, 3, 0.0, 1.875, "Leviathan: (1 - 0.5^4) / (1 - 0.5) = 1.875"),
        ([0.5] * 3, [1.0] * 3, 3, 0.25, 1.875 / 1.75, "same tokens, drafting costs 3 x 0.25 steps"),
        ([1.0] * 2, [0.5, 0.5], 2, 0.0, 2.0, "lookup proposes half the time: E = 1 + 0.5 + 0.5"),
    ],
)
def test_expected_speedup(conditional, proposal, k, c, expected, why):
    assert expected_speedup(conditional, proposal, k, c, FREE_VERIFY) == pytest.approx(expected), why


def test_curve_matches_pointwise():
    conditional, proposal = [0.9, 0.8, 0.7, 0.6], [1.0, 1.0, 0.9, 0.8]
    verify = VerifyCost(0.01, 0.001)
    curve = speedup_curve(conditional, proposal, 4, 0.1, verify)
    for k in range(1, 5):
        assert curve[k - 1] == pytest.approx(expected_speedup(conditional, proposal, k, 0.1, verify))


def test_verify_cost_is_relative_to_one_step():
    v = VerifyCost(intercept_seconds=0.02, slope_seconds=0.002)
    assert v(0) == 1.0 and v(5) == pytest.approx(1.5)


def test_fit_recovers_a_line():
    # t(n) = 10 ms + 1 ms per draft, observed at n = 0, 4, 8 with different round counts
    points = [(0.0, 0.010 * 100, 100), (4.0, 0.014 * 50, 50), (8.0, 0.018 * 10, 10)]
    v = fit_verify_cost(points)
    assert v.intercept_seconds == pytest.approx(0.010) and v.slope_seconds == pytest.approx(0.001)


def test_fit_with_one_length_keeps_the_default_shape():
    v = fit_verify_cost([(4.0, 0.5, 10)])  # 50 ms per round at n = 4
    assert v.intercept_seconds * v(4) == pytest.approx(0.05)


def test_fit_without_data_is_the_default():
    assert fit_verify_cost([]) == fit_verify_cost([(1.0, 0.0, 0.0)])


@pytest.mark.parametrize(("successes", "trials"), [(50, 100), (0, 10), (10, 10), (3.5, 7.25)])
def test_wilson_interval_contains_the_rate(successes, trials):
    low, high = wilson_interval(successes, trials)
    assert 0.0 <= low <= successes / trials <= high <= 1.0


def test_wilson_interval_narrows_with_data():
    assert (
        wilson_interval(500, 1000)[1] - wilson_interval(500, 1000)[0]
        < wilson_interval(5, 10)[1] - wilson_interval(5, 10)[0]
    )
