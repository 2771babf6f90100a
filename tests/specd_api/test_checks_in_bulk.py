"""The checks run in bulk first (specd_api/checks.py: ``_positions_hold``, ``_timings_hold``, compared in C) and name
the broken rule only when one is broken (``_name_broken_position``, ``_name_broken_timing``, the loops the messages
come from). A bulk check that lets through what the loop refuses would accept implausible telemetry; one that refuses
what the loop accepts would refuse a worker's report. So on every input they must agree."""

from __future__ import annotations

import math
import random

import pytest

from specd_api.checks import _name_broken_position, _name_broken_timing, _positions_hold, _timings_hold


def refused(check: object, *args: object) -> bool:
    try:
        check(*args)  # type: ignore[operator]
    except ValueError:
        return True
    return False


def positions(rng: random.Random) -> tuple[list[int], list[int], list[int], int]:
    """Mostly plausible per-position counts with one rule sometimes broken by one step (the cases that matter)."""
    k, rounds = rng.randint(0, 6), rng.randint(0, 9)
    proposed = sorted((rng.randint(0, rounds) for _ in range(k)), reverse=True)
    verified, accepted = [], []
    for i, p in enumerate(proposed):
        verified.append(p if i == 0 else min(p, accepted[-1]))
        accepted.append(rng.randint(0, verified[-1]))
    lists = [proposed, verified, accepted]
    if k and rng.random() < 0.7:
        which, i = rng.choice(lists), rng.randrange(k)
        which[i] += rng.choice((-1, 1, rounds + 1))
    return proposed, verified, accepted, rounds


def test_positions_in_bulk_agree_with_the_loop() -> None:
    for seed in range(3000):
        args = positions(random.Random(seed))
        assert _positions_hold(*args) == (not refused(_name_broken_position, *args)), args


@pytest.mark.parametrize(
    ("proposed", "verified", "accepted", "rounds", "holds"),
    [
        ([4, 4, 3], [4, 3, 2], [3, 2, 1], 4, True),  # tests/controller/test_store.py's four rounds
        ([], [], [], 0, True),  # K 0
        ([4, 5, 3], [4, 3, 2], [3, 2, 1], 5, False),  # proposed grows
        ([4, 4, 3], [4, 4, 2], [3, 2, 1], 4, False),  # verified at 1 above accepted at 0
        ([4, 4, 3], [3, 3, 2], [3, 2, 1], 4, False),  # position 0 verified less than proposed
        ([5, 4, 3], [5, 3, 2], [3, 2, 1], 4, False),  # proposed above the rounds
        ([4, 4, 3], [4, 3, 2], [3, 2, -1], 4, False),  # negative
        ([4, 4, 3], [4, 3, 2], [3, 4, 1], 4, False),  # accepted above verified
    ],
)
def test_positions_in_bulk(proposed, verified, accepted, rounds, holds) -> None:
    assert _positions_hold(proposed, verified, accepted, rounds) is holds
    assert refused(_name_broken_position, proposed, verified, accepted, rounds) is not holds


SECONDS = (0.0, 1e-9, 1e-7, 0.5, 59.0, 60.0, 61.0, 120.0, math.inf, -math.inf, math.nan, -0.5)


def test_timings_in_bulk_agree_with_the_loop() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        rounds = rng.randint(0, 5)
        by_rounds = [rng.choice((0, 1, 2, rounds, rounds + 1, -1)) for _ in range(rng.randint(1, 5))]
        by_seconds = [r * rng.uniform(1e-7, 60.0) if rng.random() < 0.6 else rng.choice(SECONDS) for r in by_rounds]
        args = (by_rounds, by_seconds, rounds)
        assert _timings_hold(*args) == (not refused(_name_broken_timing, *args)), args
