"""Measured costs from the workers' timings, per sampling mode and batch bucket: one target step, c per drafter, and
v(n) per n. Each mode's are its own: a sampled round samples every drafted token and softmaxes every verified
position, and costs several times a greedy one's (a drafted token 3x on two CPU cores); greedy ratios would price a
sampled request's K as if drafting were cheap. Ratios are to the same mode's plain step.

v(n), the time of a round that verified n drafts relative to a plain step, is kept per n as measured (never fitted
as a line: on a CPU in float32 it is not even monotonic). An n measured in fewer than ``MIN_ROUNDS`` rounds is
interpolated between its measured neighbours (beyond the largest, extended at the measured mean slope), and a bucket
with no timings borrows its nearest measured neighbour's ratios. Every figure is total: whatever is stored,
nothing here divides by zero or returns a non-finite number.

Each timing is the median of per-request observations (controller/decision/timing_histogram.py), not a mean of summed
seconds: on a shared machine a few stalled requests would otherwise set the costs (one 1.5 s stall among rounds of
1 ms made the draft model look 8x dearer and switched it off for good). ``BucketCosts.draw`` gives the costs under a
draw from each median's sampling distribution, which Thompson sampling uses beside its draws of α (decide.py).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from controller.decision.counts import CostCounts
from controller.decision.timing_histogram import Histogram, draw_median, median, relative_spread, total
from specd_api.checks import MAX_K
from specd_api.modes import GREEDY, MODES, Mode
from specd_api.plan import batch_bucket

MIN_ROUNDS = 20.0  # (decayed) rounds before a v(n) is taken as measured: a few rounds timed on a busy machine
# would otherwise set it, and a segment switched off by them drafts no more rounds to correct it
MIN_DRAFTED = 50.0  # (decayed) drafted tokens before a c is
MIN_REQUESTS = 3.0  # (decayed) requests in a timing histogram before its median is read (else the plain mean)
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
    timings: Timings | None = field(default=None, compare=False, repr=False)  # what it was read from
    mode: Mode = GREEDY  # the sampling mode of the rounds timed

    def c(self, drafter: str, default: float) -> float:
        return self.cost_ratio.get(drafter, default)

    def draw(self, rng: random.Random) -> BucketCosts:
        """The costs under one draw of each timing's median from its sampling distribution (timing_histogram): a
        cost measured by a few requests varies widely, so exploration can overturn it as it overturns an α."""
        if self.timings is None:
            return self
        drawn = self.timings.costs(self.bucket, lambda t: t if isinstance(t, float) else draw_median(t, rng), self.mode)
        return self if drawn is None else replace(drawn, cost_ratio={**self.cost_ratio, **drawn.cost_ratio})

    def verify_table(self, k: int) -> tuple[float, ...]:
        """v(0..k)."""
        return self.verify[: k + 1]


DEFAULT_BUCKET = BucketCosts(bucket=1, step_seconds=0.0)
COSTS_TOLERANCE = 0.01  # a point cost that moved less than this share moves no decision table (their own tolerance)


def costs_moved(before: CostModel, after: CostModel, tolerance: float = COSTS_TOLERANCE) -> bool:
    """Whether a cost decisions read moved from ``before`` to ``after`` by more than ``tolerance`` of itself: a
    bucket measured or not, a drafter's c known or not, a step time, a c or a v(n) moved past it. The rounds behind
    each v(n), and the timings behind each median, do not count. A decay step moves every weighted median a little:
    compared with the model of the last move, small moves add up until they count."""
    if before.buckets.keys() != after.buckets.keys():
        return True
    for key, new in after.buckets.items():
        old = before.buckets[key]
        if (old.measured, old.cost_ratio.keys(), len(old.verify)) != (
            new.measured,
            new.cost_ratio.keys(),
            len(new.verify),
        ):
            return True
        pairs = [(old.step_seconds, new.step_seconds), *zip(old.verify, new.verify, strict=True)]
        pairs += [(old.cost_ratio[d], new.cost_ratio[d]) for d in new.cost_ratio]
        if any(not math.isclose(x, y, rel_tol=tolerance) for x, y in pairs):
            return True
    return False


@dataclass(frozen=True)
class CostModel:
    buckets: Mapping[tuple[Mode, int], BucketCosts] = field(default_factory=dict)  # measured (mode, bucket) only

    def at(self, batch_size: int, mode: Mode = GREEDY) -> BucketCosts:
        """The costs at ``batch_size`` for requests of ``mode``: its bucket's, else the nearest measured bucket's of
        the same mode (ratios carry over better than the literature's), else the other mode's (a sampled round costs
        more than that: the worker's start-up calibration times both modes, so this is rare), else the defaults.
        Borrowed costs have no step seconds and are not ``measured``."""
        bucket = batch_bucket(batch_size)
        if (mode, bucket) in self.buckets:
            return self.buckets[(mode, bucket)]
        for source in (mode, *(m for m in MODES if m != mode)):
            measured = [b for m, b in self.buckets if m == source]
            if measured:
                nearest = min(measured, key=lambda b: (abs(math.log2(b) - math.log2(bucket)), b))
                borrowed = self.buckets[(source, nearest)]
                return BucketCosts(bucket, 0.0, borrowed.cost_ratio, borrowed.verify, (), measured=False, mode=mode)
        return BucketCosts(bucket=bucket, step_seconds=0.0, mode=mode)


def build_cost_model(costs: CostCounts) -> CostModel:
    keys = {(m, b) for _, b, m in costs.verify_rounds}
    model: dict[tuple[Mode, int], BucketCosts] = {}
    for mode, b in sorted(keys):
        measured = _bucket(costs, b, mode)
        if measured is not None:
            model[(mode, b)] = measured
    # A drafter timed in another bucket only: borrow its nearest measured c of the same mode (still better than the
    # policy's guess).
    for (mode, b), bc in list(model.items()):
        missing = {d for d, _, m in costs.drafted if m == mode} - set(bc.cost_ratio)
        borrowed = dict(bc.cost_ratio)
        for d in missing:
            others = [
                (abs(math.log2(o) - math.log2(b)), o)
                for (m, o), oc in model.items()
                if m == mode and d in oc.cost_ratio
            ]
            if others:
                borrowed[d] = model[(mode, min(others)[1])].cost_ratio[d]
        if borrowed != bc.cost_ratio:
            model[(mode, b)] = replace(bc, cost_ratio=borrowed)
    return CostModel(model)


@dataclass(frozen=True)
class Timings:
    """What a bucket's costs are read from: per n, the seconds of one round that verified n drafts, and per drafter
    the seconds of drafting one token, each as a histogram of per-request observations (read as its median) or,
    while its histogram holds fewer than ``MIN_REQUESTS`` requests, as the plain mean of the summed seconds (no
    spread: a point)."""

    verify: Mapping[int, Histogram | float]
    rounds: Mapping[int, float]  # (decayed) rounds behind each verify entry
    draft: Mapping[str, Histogram | float]

    def costs(self, bucket: int, pick: Callable[[Histogram | float], float], mode: Mode = GREEDY) -> BucketCosts | None:
        """The bucket's costs with each timing read by ``pick`` (its median, or a draw of it); None when no plain
        step can be derived."""
        seconds = {n: pick(t) for n, t in self.verify.items()}
        seconds = {n: s for n, s in seconds.items() if _usable(s) and s > 0}
        if not seconds:
            return None
        n_min = min(seconds)
        # One plain step: measured, or inferred from the shortest measured length at the default slope.
        t0 = seconds[0] if 0 in seconds else seconds[n_min] / (1.0 + DEFAULT_VERIFY_SLOPE * n_min)
        if not (_usable(t0) and t0 > 0):
            return None
        points = {0: 1.0} | {n: t / t0 for n, t in seconds.items()}
        verify = _verify_table(points, TABLE_SIZE)
        ratios = {}
        for d, t in self.draft.items():
            c = pick(t) / t0
            if _usable(c):
                ratios[d] = c
        table_rounds = tuple(self.rounds.get(n, 0.0) if n in seconds else 0.0 for n in range(max(seconds) + 1))
        return BucketCosts(bucket, t0, ratios, verify, table_rounds, measured=True, timings=self, mode=mode)

    def spread(self) -> float:
        """The largest relative standard error among the bucket's medians (0: all points)."""
        timings = (*self.verify.values(), *self.draft.values())
        return max((relative_spread(t) for t in timings if not isinstance(t, float)), default=0.0)


def _median_of(timing: Histogram | float) -> float:
    return timing if isinstance(timing, float) else median(timing)


def _bucket(costs: CostCounts, bucket: int, mode: Mode = GREEDY) -> BucketCosts | None:
    """The bucket's costs for ``mode``'s rounds, or None when it has no usable timing at all."""
    verify: dict[int, Histogram | float] = {}
    rounds: dict[int, float] = {}
    for (n, b, m), r in costs.verify_rounds.items():
        if b != bucket or m != mode or not (0 <= n < TABLE_SIZE) or r < MIN_ROUNDS:
            continue
        hist = costs.verify_hist.get((n, b, m), {})
        s = costs.verify_s.get((n, b, m), 0.0)
        if total(hist) >= MIN_REQUESTS:
            verify[n], rounds[n] = dict(hist), r
        elif _usable(s) and s > 0:
            verify[n], rounds[n] = s / r, r
    draft: dict[str, Histogram | float] = {}
    for (d, b, m), drafted in costs.drafted.items():
        if b != bucket or m != mode or drafted < MIN_DRAFTED:
            continue
        hist = costs.draft_hist.get((d, b, m), {})
        if total(hist) >= MIN_REQUESTS:
            draft[d] = dict(hist)
        else:
            draft[d] = costs.draft_s.get((d, b, m), 0.0) / drafted
    return Timings(verify, rounds, draft).costs(bucket, _median_of, mode)


def _verify_table(points: Mapping[int, float], size: int) -> tuple[float, ...]:
    """v(0..size - 1) from measured points (0 always among them), in one pass over them in order: a measured n is
    the point itself, else linear between its nearest measured neighbours, else beyond the largest at the measured
    mean slope (v(largest) - 1) / largest, never below the default: on a CPU verifying grows by 0.1-0.2 steps a
    token, and the GPU's 0.02 would make a K never tried look almost free (v(8) read as 1.58 where it is 2.56, and
    K 5-6 chosen where 2-3 is best). Computed once per cost draw: a decision table draws the costs ~70 times."""
    measured = sorted(points)
    largest = measured[-1]
    slope = max((points[largest] - points[0]) / largest, DEFAULT_VERIFY_SLOPE) if largest else DEFAULT_VERIFY_SLOPE
    table, i = [], 0  # measured[i] <= n < measured[i + 1]
    for n in range(size):
        while i + 1 < len(measured) and measured[i + 1] <= n:
            i += 1
        below = measured[i]
        if below == n:
            table.append(points[n])
        elif i + 1 < len(measured):
            hi = measured[i + 1]
            table.append(points[below] + (points[hi] - points[below]) * (n - below) / (hi - below))
        else:
            table.append(points[below] + slope * (n - below))
    return tuple(table)


def _usable(x: float) -> bool:
    return math.isfinite(x) and x >= 0
