"""Robust timing estimates: per-request timings kept as a log-binned histogram, read back as quantiles. Pure.

A round's time is heavy-tailed: on a shared machine one request in twenty may be stalled (another process on the
cores, a page fault, a kernel plan built once) and run 10-1000x slower than its neighbours. A mean of summed
timings is then the stall's, and one stall can switch a drafter off for good. Here each request contributes one
observation (its mean seconds per round, or per drafted token) to a histogram of log-spaced bins, kept in Redis as
hash fields that add up like every other counter (decayed with the same weights); the cost is the histogram's
median, which a minority of stalled requests cannot move by more than the width of the few ranks they shift it.

What a stall is, in these terms: an observation in the histogram's upper tail. It is not removed or recognised one
by one (no threshold to tune); it simply holds a rank, and a rank above the median does not move the median.

The estimate's uncertainty is the sampling distribution of a median: the k-th of n order statistics of a sample
from F lies at F^-1(U) with U ~ Beta(k, n + 1 - k). ``draw_median`` draws U for k = n / 2 and reads the quantile off
the histogram, so that a cost measured by three requests is drawn widely (exploration can overturn it) and one
measured by three hundred is a point.
"""

from __future__ import annotations

import math
import operator
import random
from collections import Counter
from collections.abc import Iterable, Mapping, MutableMapping
from itertools import repeat

BINS_PER_OCTAVE = 16  # bins 4.4% wide; the quantile is interpolated within its bin
MIN_BIN, MAX_BIN = -40 * BINS_PER_OCTAVE, 16 * BINS_PER_OCTAVE  # 2^-40 s (1 ps) .. 2^16 s (18 h): clamped beyond

Histogram = Mapping[int, float]  # bin -> (decayed) number of observations


def bin_of(seconds: float) -> int | None:
    """The bin of one observation; None for one that is not a positive finite time (it is not recorded)."""
    if not (math.isfinite(seconds) and seconds > 0):
        return None
    return min(max(math.floor(math.log2(seconds) * BINS_PER_OCTAVE), MIN_BIN), MAX_BIN)


def count_bins(seconds: Iterable[float]) -> Counter[int]:
    """How many of ``seconds`` fall in each bin: ``Counter(bin_of(s) for s in seconds)`` without the None. When
    every value is a positive finite time, the same arithmetic as ``bin_of`` runs in C, value by value (a report at
    the size bound holds 33,000 timings: 3 ms, not 10)."""
    values = list(seconds)
    if not (all(map(math.isfinite, values)) and min(values, default=1.0) > 0):
        return Counter(b for b in map(bin_of, values) if b is not None)
    counts: Counter[int] = Counter()
    for b, n in Counter(map(math.floor, map(operator.mul, map(math.log2, values), repeat(BINS_PER_OCTAVE)))).items():
        counts[min(max(b, MIN_BIN), MAX_BIN)] += n
    return counts


def bin_low(b: int) -> float:
    """The smallest time in bin ``b``."""
    return 2.0 ** (b / BINS_PER_OCTAVE)


def add_into(into: MutableMapping[int, float], other: Histogram) -> None:
    """Add ``other``'s observations to ``into``, bin by bin."""
    for b, w in other.items():
        into[b] = into.get(b, 0.0) + w


def total(histogram: Histogram) -> float:
    """The (decayed) number of observations; corrupt weights count as none."""
    return sum(_weight(w) for w in histogram.values())


def quantile(histogram: Histogram, q: float) -> float:
    """The time below which a share ``q`` of the observations lie (log-linear within a bin); 0 when empty."""
    bins = sorted((b, _weight(w)) for b, w in histogram.items() if _weight(w) > 0)
    n = sum(w for _, w in bins)
    if n <= 0:
        return 0.0
    target = min(max(q, 0.0), 1.0) * n
    below = 0.0
    for b, w in bins:
        if below + w >= target:
            inside = (target - below) / w  # share of this bin's mass under the quantile
            return 2.0 ** ((b + inside) / BINS_PER_OCTAVE)
        below += w
    return 2.0 ** ((bins[-1][0] + 1) / BINS_PER_OCTAVE)


def median(histogram: Histogram) -> float:
    return quantile(histogram, 0.5)


def draw_median(histogram: Histogram, rng: random.Random) -> float:
    """A draw from the median's sampling distribution (module docstring); 0 when empty."""
    n = total(histogram)
    if n <= 0:
        return 0.0
    half = n / 2.0
    u = rng.betavariate(half + 0.5, half + 0.5) if n < 1e9 else 0.5  # a point past any real count
    return quantile(histogram, u)


def relative_spread(histogram: Histogram) -> float:
    """The standard error of the median relative to it (the median's own uncertainty, not the data's spread):
    1.2533 * sigma / sqrt(n), with sigma from the interquartile range. 0 when empty."""
    n = total(histogram)
    mid = median(histogram)
    if n <= 0 or mid <= 0:
        return 0.0
    sigma = (quantile(histogram, 0.75) - quantile(histogram, 0.25)) / 1.349
    return 1.2533 * sigma / math.sqrt(n) / mid


def _weight(w: float) -> float:
    w = float(w)
    return w if math.isfinite(w) and w > 0 else 0.0
