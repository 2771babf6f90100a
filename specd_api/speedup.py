"""The speedup model, shared by the controller (which K and drafter) and the worker (which K this round). Pure.

With conditional acceptance a_i at draft position i (accepted / verified) and proposal rate pi_i (the drafter
had a token for position i, over rounds allowed to reach it), a round with ceiling K

    emits  E(K) = 1 + sum_{i<K} pi_i * prod_{j<=i} a_j       tokens  (Leviathan et al. 2023, per position), and
    costs  c * E[N] + E[v(N)]                                 target steps, N = tokens drafted, N <= K,

where c is the cost of drafting one token and v(n) the cost of verifying n drafts plus the head token, both
relative to one target step (v(0) = 1). P(N >= i + 1) = pi_i, so E[N] = sum pi_i and E[v(N)] weighs each
v(n) by P(N = n) = pi_{n-1} - pi_n. v is a table, measured per n (never a fitted line: on a CPU in float32
it is not even monotonic). The speedup over plain decoding (one token per step) is their ratio.

Every function here is total: rates are clamped to [0, 1], costs to >= 0, and no division can fail.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

MIN_ROUND_COST = 1e-9  # target steps; a round always costs something (guards a zero cost table)


def verify_at(verify: Sequence[float], n: int, slope: float = 0.0) -> float:
    """v(n) from a table v[0..]; beyond its end, the last entry plus ``slope`` per extra token. A corrupt entry
    (negative, not a number) counts as one step."""
    if not verify:
        return _cost(1.0 + slope * n)
    if n < len(verify):
        return _cost(verify[n])
    return _cost(verify[-1]) + _cost(slope) * (n - len(verify) + 1)


def _cost(value: float) -> float:
    value = float(value)
    return value if math.isfinite(value) and value >= 0 else 1.0


def speedup_curve(
    conditional: Sequence[float],
    proposal: Sequence[float],
    k_max: int,
    c: float,
    verify: Sequence[float],
    verify_slope: float = 0.0,
) -> list[float]:
    """Expected speedup for K = 1..k_max, in one pass over the positions.

    ``conditional`` and ``proposal`` need at least ``k_max`` entries (missing ones count as 0).
    """
    c = max(c, 0.0) if math.isfinite(c) else 0.0
    rates, proposals, v = (
        _rates(conditional, k_max),
        _rates(proposal, k_max),
        _verify_costs(verify, k_max, verify_slope),
    )
    curve = []
    tokens, survive = 1.0, 1.0
    drafted = 0.0  # E[N] for the ceiling K
    reached = 1.0  # pi_{i-1}: P(N >= i)
    verify_mass = 0.0  # sum over n < K of P(N = n) v(n), the part of E[v(N)] that no larger K changes
    for i in range(k_max):  # one pass, plain floats: Decide draws a curve per drafter, twice when it may probe
        pi = min(proposals[i], reached)  # a drafter cannot reach position i more often than i - 1
        survive *= rates[i]
        tokens += pi * survive
        drafted += pi
        verify_mass += (reached - pi) * v[i]  # P(N = i) v(i)
        reached = pi
        cost = c * drafted + verify_mass + reached * v[i + 1]  # + P(N = K) v(K)
        curve.append(tokens / max(cost, MIN_ROUND_COST))
    return curve


def _verify_costs(verify: Sequence[float], n_max: int, slope: float = 0.0) -> list[float]:
    """``verify_at(verify, n, slope)`` for n = 0..n_max, at once."""
    if not verify or n_max < 0:
        return [verify_at(verify, n, slope) for n in range(n_max + 1)]
    table = [_cost(value) for value in verify[: n_max + 1]]
    if len(table) <= n_max:
        last, step, end = _cost(verify[-1]), _cost(slope), len(verify)
        table.extend(last + step * (n - end + 1) for n in range(end, n_max + 1))
    return table


def _rates(values: Sequence[float], n: int) -> list[float]:
    """The first ``n`` rates of ``values`` as floats clamped to [0, 1]; one not finite, or missing, is 0."""
    head = values[:n]
    # The usual case, rates already (a NaN anywhere makes the sum NaN; an infinity fails a bound): no clamp.
    if len(head) and min(head) >= 0.0 and max(head) <= 1.0 and math.isfinite(sum(head)):
        rates = list(map(float, head))
    else:
        rates = [min(max(v, 0.0), 1.0) if math.isfinite(v) else 0.0 for v in map(float, head)]
    return rates + [0.0] * (n - len(rates))


def best_k(curve: Sequence[float], k_min: int = 1) -> tuple[int, float]:
    """(K, speedup) of the best entry of a curve for K = 1..len(curve), K >= k_min; (0, 1.0) when empty."""
    best, value = 0, 1.0
    for k in range(max(k_min, 1), len(curve) + 1):
        if best == 0 or curve[k - 1] > value:
            best, value = k, curve[k - 1]
    return best, value


def wilson_interval(successes: float, trials: float, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a rate (works on decayed, fractional counts)."""
    if not (trials > 0 and math.isfinite(trials)):
        return 0.0, 1.0
    p = min(max(successes / trials, 0.0), 1.0)
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def ratio(numerator: float, denominator: float, default: float = 0.0) -> float:
    """numerator / denominator, or ``default`` when that is not a finite number (empty or corrupt counts)."""
    if denominator == 0 or not (math.isfinite(numerator) and math.isfinite(denominator)):
        return default
    value = numerator / denominator
    return value if math.isfinite(value) else default


MODEL_DRAFTERS = ("draft", "chain")  # the drafters that run the draft model (a chain when lookup finds no match)
DRAFT_MODEL = "draft"  # the component every model drafter runs: its cost and calibration are measured under this name


HEAD_DRAFTERS = ("eagle",)  # the drafters that run a draft head on the target's hidden states


def runs_head(drafter: str) -> bool:
    """Does ``drafter`` run a draft head (decoder/heads): offered only by a worker given one?"""
    return drafter in HEAD_DRAFTERS


def runs_draft_model(drafter: str) -> bool:
    """Does ``drafter`` run the draft model (its prefill, its stop rule, a proposal at every position)?"""
    return drafter in MODEL_DRAFTERS


def cost_component(drafter: str) -> str:
    """What ``drafter``'s drafting cost and calibration are those of: the draft model's (``draft``) for every drafter
    that runs it, a chain included; the drafter's own otherwise."""
    return DRAFT_MODEL if runs_draft_model(drafter) else drafter


def chain_cost_ratio(draft_model_c: float, lookup_hit: float) -> float:
    """A chain's c: the draft model's for the rounds prompt lookup finds no match in (1 - ``lookup_hit``, the share of
    rounds lookup proposes in), lookup's ~0 for the others."""
    hit = min(max(lookup_hit, 0.0), 1.0) if math.isfinite(lookup_hit) else 0.0
    return max(draft_model_c, 0.0) * (1.0 - hit) if math.isfinite(draft_model_c) else 0.0


def repays_prefill(
    drafter: str, speedup: float, max_new_tokens: int, prompt_tokens: int, cost_ratio: float,
    prefill_cost_per_token: float,
) -> bool:  # fmt: skip
    """Does running ``drafter`` at ``speedup`` save more target steps over ``max_new_tokens`` than it costs up front?
    Only a draft model pays up front: its own prefill of the prompt, ``cost_ratio * prompt_tokens *
    prefill_cost_per_token`` target steps."""
    saved_steps = max_new_tokens * (1.0 - 1.0 / speedup) if speedup > 0 else 0.0
    prefill_steps = cost_ratio * prompt_tokens * prefill_cost_per_token if runs_draft_model(drafter) else 0.0
    return saved_steps > prefill_steps
