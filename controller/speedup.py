"""Expected speedup of a drafter at K, from per-position acceptance and measured costs (pure).

With conditional acceptance a_i at draft position i (accepted / verified) and proposal rate π_i
(the drafter had a token for position i), the expected tokens per round are
    E(K) = 1 + Σ_{i<K} π_i Π_{j≤i} a_j            (Leviathan et al. 2023, with per-position rates)
and a round costs c·n̄(K) + v(n̄(K)) target steps, n̄(K) = Σ_{i<K} π_i the expected drafted tokens,
c the cost of drafting one token and v(n) of verifying n drafts, relative to one target step.
The speedup over plain decoding (one token per v(0) = 1 step) is E(K) / (c·n̄ + v(n̄)).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class VerifyCost:
    """v(n) = t(n) / t(0): verification time of n drafts (plus the head token) relative to one step."""

    intercept_seconds: float  # t(0), one target step
    slope_seconds: float  # extra seconds per verified draft token

    def __call__(self, n: float) -> float:
        return 1.0 + self.slope_seconds * n / self.intercept_seconds


# Literature default until measurements exist: on a GPU at batch 1 verifying K tokens costs about one step.
DEFAULT_VERIFY = VerifyCost(intercept_seconds=1.0, slope_seconds=0.02)


def fit_verify_cost(points: Sequence[tuple[float, float, float]], fallback: VerifyCost = DEFAULT_VERIFY) -> VerifyCost:
    """Least-squares line t(n) = t0 + s·n through (n, total seconds, rounds) points, weighted by rounds."""
    total = sum(w for _, _, w in points)
    if total <= 0 or len({n for n, _, w in points if w > 0}) < 2:
        if total > 0 and len(points) >= 1:  # one length only: keep the default slope, scale to its time
            n, seconds, rounds = max(points, key=lambda p: p[2])
            per_round = seconds / rounds
            t0 = per_round / fallback(n)
            return VerifyCost(t0, fallback.slope_seconds / fallback.intercept_seconds * t0)
        return fallback
    mean_n = sum(n * w for n, _, w in points) / total
    mean_t = sum(s for _, s, _ in points) / total  # Σ seconds / Σ rounds = weighted mean per-round time
    var = sum(w * (n - mean_n) ** 2 for n, _, w in points)
    cov = sum((n - mean_n) * (s - mean_t * w) for n, s, w in points)  # Σ w (n - n̄)(t_n - t̄), t_n w = s
    slope = max(cov / var, 0.0) if var > 0 else 0.0
    t0 = mean_t - slope * mean_n
    if t0 <= 0:
        return VerifyCost(mean_t, 0.0)
    return VerifyCost(t0, slope)


def speedup_curve(
    conditional: Sequence[float], proposal: Sequence[float], k_max: int, c: float, verify: VerifyCost
) -> list[float]:
    """Expected speedup for K = 1..k_max in one pass over the positions.

    E(K) = 1 + Σ_{i<K} π_i Π_{j≤i} a_j tokens per round, n̄(K) = Σ_{i<K} π_i drafted tokens,
    speedup = E(K) / (c·n̄ + v(n̄)).
    """
    curve = []
    tokens, survive, drafted = 1.0, 1.0, 0.0
    for i in range(k_max):
        survive *= conditional[i]
        tokens += proposal[i] * survive
        drafted += proposal[i]
        curve.append(tokens / (c * drafted + verify(drafted)))
    return curve


def expected_speedup(
    conditional: Sequence[float], proposal: Sequence[float], k: int, c: float, verify: VerifyCost
) -> float:
    return speedup_curve(conditional, proposal, k, c, verify)[-1] if k > 0 else 1.0


def wilson_interval(successes: float, trials: float, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a rate (works on decayed, fractional counts)."""
    if trials <= 0:
        return 0.0, 1.0
    p = successes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)
