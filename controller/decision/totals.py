"""Per-position counts inferred from a request's totals, for an engine that reports only how many tokens it drafted
and how many were accepted (llama.cpp's server). Pure.

**The model.** Every round that drafts proposes the full K (a draft model run with no early stop; prompt lookup's
rounds that find a match), and each drafted position is accepted with the same conditional probability ``a`` once
every earlier one was: a round's expected accepted count is a + a² + … + a^K. The drafting rounds are the fewest
that hold the drafted tokens, ceil(drafted / K), at most the steps: the rest of the steps found nothing to draft, which
is what the proposal rate at position 0 says. ``a`` solves accepted / drafting rounds = a + … + a^K (method of
moments; monotone in ``a``, so bisection finds it), and position i's expected accepted count is rounds · a^(i+1).

**The counts** are those expectations as integers that obey every rule a detailed report obeys
(``specd_api.checks``): accepted at a position at most verified, verified at most the earlier position's accepted,
proposed non-increasing; they add up to the totals exactly (drafted and accepted), so α = accepted / drafted per K
is what the engine counted.

**The uncertainty.** The counts carry as many trials as the model says the rounds held (accepted plus the rounds
that rejected a token), so a Beta over them is as wide as a detailed report of the same rounds would make it when
the model holds. Where acceptance falls with the position faster than a constant rate, the first positions are
under-estimated and the last over-estimated; the request's realised speedup, which the decision reads as the data
once a plan has it (``realised``), does not depend on this model.
"""

from __future__ import annotations

import math

BISECTION_STEPS = 60  # halves [0, 1] to below float resolution


def conditional_rate(per_round: float, k: int) -> float:
    """The constant conditional acceptance ``a`` in [0, 1] whose round accepts ``per_round`` tokens on average at
    ceiling ``k`` (a + a² + … + a^k = per_round); 0 and 1 at the ends, and 0 for k < 1."""
    if k < 1 or not per_round > 0:
        return 0.0
    if per_round >= k:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(BISECTION_STEPS):
        mid = (low + high) / 2
        if _accepted_per_round(mid, k) < per_round:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def _accepted_per_round(a: float, k: int) -> float:
    return sum(a**i for i in range(1, k + 1))


def positions_from_totals(rounds: int, k: int, drafted: int, accepted: int) -> tuple[list[int], list[int], list[int]]:
    """Proposed, verified and accepted counts per position 0..k-1 for ``rounds`` steps at ceiling ``k`` that drafted
    ``drafted`` tokens and had ``accepted`` of them accepted (0 <= accepted <= drafted <= rounds * k, as checked at
    the door): they add up to ``drafted`` and ``accepted``."""
    if k < 1 or drafted <= 0:
        return [0] * max(k, 0), [0] * max(k, 0), [0] * max(k, 0)
    drafting = min(rounds, -(-drafted // k))
    short = drafting * k - drafted  # 0 <= short < k: the last positions of that many rounds were not proposed
    proposed = [drafting - (1 if i >= k - short else 0) for i in range(k)]
    a = conditional_rate(accepted / drafting, k)
    expected = [drafting * a ** (i + 1) for i in range(k)]
    scale = accepted / sum(expected) if sum(expected) > 0 else 0.0
    # rounded running sums: each position within one of its expectation, the whole exactly the accepted tokens
    running = [round(scale * math.fsum(expected[: i + 1])) for i in range(k)]
    accepted_at = [min(running[i] - (running[i - 1] if i else 0), proposed[i]) for i in range(k)]
    for i in range(1, k):
        accepted_at[i] = min(accepted_at[i], accepted_at[i - 1])
    missing = accepted - sum(accepted_at)  # what the rules clipped, given to the earliest positions with room
    for i in range(k):
        if missing <= 0:
            break
        room = min(proposed[i], accepted_at[i - 1] if i else proposed[i]) - accepted_at[i]
        added = min(room, missing)
        accepted_at[i] += added
        missing -= added
    verified = [proposed[0]] + [min(proposed[i], accepted_at[i - 1]) for i in range(1, k)]
    return proposed, verified, accepted_at
