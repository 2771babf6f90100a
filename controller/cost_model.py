"""Measured costs from the workers' timings, per batch bucket: one target step, c per drafter, and v(n) per n.

v(n), the time of a round that verified n drafts relative to a plain step, is kept per n as measured (never fitted
as a line: on a CPU in float32 it is not even monotonic). An n measured in fewer than ``MIN_ROUNDS`` rounds is
interpolated between its measured neighbours (beyond the largest, extended at the default slope), and a bucket
with no timings borrows its nearest measured neighbour's ratios. Every figure is total: whatever is stored,
nothing here divides by zero or returns a non-finite number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from controller.counts import CostCounts
from specd_api.checks import MAX_K
from specd_api.plan import batch_bucket

MIN_ROUNDS = 20.0  # (decayed) rounds before a v(n) is taken as measured: a few rounds timed on a busy machine
# would otherwise set it, and a segment switched off by them drafts no more rounds to correct it
MIN_DRAFTED = 50.0  # (decayed) drafted tokens before a c is
DEFAULT_VERIFY_SLOPE = 0.02  # the literature's v(n) = 1 + 0.02 n (a GPU at batch 1), until measured
TABLE_SIZE = MAX_K + 1  # v(0..MAX_K)


def default_verify() -> tuple[float, ...]:
    return tuple(1.0 + DEFAULT_VERIFY_SLOPE * n for n in range(TABLE_SIZE))


@dataclass(frozen=True)
class BucketCosts:
    bucket: int
    step_seconds: float  # one plain target step, one sequence's share (0 when not measured)
    cost_ratio: Mapping[str, float] = field(default_factory=dict)  # measured c per drafter
    verify: tuple[float, ...] = field(default_factory=default_verify)  # v(n), n = 0..MAX_K
    rounds: tuple[float, ...] = ()  # (decayed) rounds behind each measured v(n); shorter or 0 = interpolated
    measured: bool = False

    def c(self, drafter: str, default: float) -> float:
        return self.cost_ratio.get(drafter, default)

    def verify_table(self, k: int) -> tuple[float, ...]:
        """v(0..k)."""
        return self.verify[: k + 1]


DEFAULT_BUCKET = BucketCosts(bucket=1, step_seconds=0.0)


@dataclass(frozen=True)
class CostModel:
    buckets: Mapping[int, BucketCosts] = field(default_factory=dict)  # measured buckets only

    def at(self, batch_size: int) -> BucketCosts:
        """The costs at ``batch_size``: its bucket's, else the nearest measured bucket's (ratios carry over better
        than the literature's), else the defaults."""
        bucket = batch_bucket(batch_size)
        if bucket in self.buckets:
            return self.buckets[bucket]
        if not self.buckets:
            return BucketCosts(bucket=bucket, step_seconds=0.0)
        nearest = min(self.buckets, key=lambda b: (abs(math.log2(b) - math.log2(bucket)), b))
        borrowed = self.buckets[nearest]
        return BucketCosts(bucket, 0.0, borrowed.cost_ratio, borrowed.verify, (), measured=False)


def build_cost_model(costs: CostCounts) -> CostModel:
    buckets = {b for _, b in costs.verify_rounds}
    model = {}
    for b in sorted(buckets):
        measured = _bucket(costs, b)
        if measured is not None:
            model[b] = measured
    # A drafter timed in another bucket only: borrow its nearest measured c (still better than the policy's guess).
    for b, bc in list(model.items()):
        missing = {d for d, _ in costs.drafted} - set(bc.cost_ratio)
        borrowed = dict(bc.cost_ratio)
        for d in missing:
            others = [(abs(math.log2(o) - math.log2(b)), o) for o, oc in model.items() if d in oc.cost_ratio]
            if others:
                borrowed[d] = model[min(others)[1]].cost_ratio[d]
        if borrowed != bc.cost_ratio:
            model[b] = BucketCosts(b, bc.step_seconds, borrowed, bc.verify, bc.rounds, bc.measured)
    return CostModel(model)


def _bucket(costs: CostCounts, bucket: int) -> BucketCosts | None:
    """The bucket's costs, or None when it has no usable timing at all."""
    seconds: dict[int, float] = {}
    rounds: dict[int, float] = {}
    for (n, b), r in costs.verify_rounds.items():
        s = costs.verify_s.get((n, b), 0.0)
        if b == bucket and 0 <= n < TABLE_SIZE and r >= MIN_ROUNDS and _usable(s) and s > 0:
            seconds[n], rounds[n] = s / r, r
    if not seconds:
        return None
    n_min = min(seconds)
    # One plain step: measured, or inferred from the shortest measured length at the default slope.
    t0 = seconds[0] if 0 in seconds else seconds[n_min] / (1.0 + DEFAULT_VERIFY_SLOPE * n_min)
    if not (_usable(t0) and t0 > 0):
        return None
    points = {0: 1.0} | {n: t / t0 for n, t in seconds.items()}
    verify = tuple(_interpolate(points, n) for n in range(TABLE_SIZE))
    ratios = {}
    for (d, b), drafted in costs.drafted.items():
        if b == bucket and drafted >= MIN_DRAFTED:
            c = costs.draft_s.get((d, b), 0.0) / drafted / t0
            if _usable(c):
                ratios[d] = c
    table_rounds = tuple(rounds.get(n, 0.0) for n in range(max(seconds) + 1))
    return BucketCosts(bucket, t0, ratios, verify, table_rounds, measured=True)


def _interpolate(points: Mapping[int, float], n: int) -> float:
    """v(n) from measured points (0 always among them): the point itself, else linear between the nearest measured
    neighbours, else beyond the largest at the default slope."""
    if n in points:
        return points[n]
    below = max(m for m in points if m < n)
    above = [m for m in points if m > n]
    if not above:
        return points[below] + DEFAULT_VERIFY_SLOPE * (n - below)
    hi = min(above)
    return points[below] + (points[hi] - points[below]) * (n - below) / (hi - below)


def _usable(x: float) -> bool:
    return math.isfinite(x) and x >= 0
