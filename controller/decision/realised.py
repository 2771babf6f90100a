"""What a plan realised in a segment, against the one reference both expected and realised speedups are read at,
and the posterior that makes it the decision's currency. Pure.

**The reference** is the segment's plain step on its workers (``plain_reference``): the median of its own plain rounds
(``st|``), shrunk in log space towards the fleet's plain step for the same sampling mode and batch bucket by
REFERENCE_PRIOR_REQUESTS pseudo-requests, so that it moves smoothly from the fleet's to the segment's own as its plain
rounds arrive (never a switch at a count). A segment that always speculates has few plain rounds of its own: its plans
then run one plain round once the request is steady (REFERENCE_REQUESTS, PLAIN_ROUNDS,
``specd_api.round_policy.PLAIN_ROUNDS_FROM``). The controller reads a request's realised speedup at
this reference when it stores the request's calibration, and a decision reads a plan's realised speedup at it: one
reference.

**Realised** (``realised``): the reference over the median seconds per emitted token of the segment's requests that
ran the plan's drafter (``sp|``; each request one observation, so a stalled one holds one rank), with the standard
error of that log ratio: the median's (1.2533 sigma / sqrt(n), sigma no lower than REQUEST_LOG_SD, one request's
spread on a quiet machine) and the reference's.

**The posterior** (``posterior``): the model's expected speedup (α, c, v(n), scaled by its calibration) is a prior on
the log speedup with spread MODEL_LOG_SD; the realised figure, once MIN_REQUESTS requests stand behind it, is the
data. Their precision-weighted mean is the plan's expected speedup; its lower credible bound (``lower``, LOWER_Z
standard deviations down) ranks plans, so that an arm seen only through its prior beats a measured one only when
its prior is well clear of what the measured one realised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controller.decision.timing_histogram import Histogram, median, quantile, total

REFERENCE_PRIOR_REQUESTS = 3.0  # the fleet's plain step weighs as much as this many of the segment's own requests
# Until a segment's own plain rounds come from this many (decayed) requests, its plans run PLAIN_ROUNDS plain rounds
# (Plan.plain_rounds): one plain step in the request's own context, about 1 % of a 128-token request
# that speculates at 2x. A segment's contexts set its plain step (2.1-2.6 ms a token between the shipped segments on
# two CPU cores): the fleet's alone would misread what its plans realise by as much.
REFERENCE_REQUESTS = 12.0
PLAIN_ROUNDS = 1
MIN_REQUESTS = 3.0  # (decayed) requests of a plan before what it realised counts: the median of two may be a stall
REQUEST_LOG_SD = 0.15  # one request's spread in log seconds per token, at least (the machines here: +-15 % a request)
MODEL_LOG_SD = 0.25  # how far the model's speedup typically lies from what a plan realises (log)
LOWER_Z = 1.0  # plans are ranked by exp(mean - LOWER_Z sd) of their log speedup: an 84 % lower credible bound
MAX_LOG = 5.0  # |log speedup| past this (148x) is corrupt data, not a measurement


def plain_reference(own: Histogram, fleet_seconds: float) -> float:
    """A plain step's seconds in a segment: its own plain rounds' median (``own``: requests by seconds per plain
    round), shrunk in log space towards ``fleet_seconds`` by REFERENCE_PRIOR_REQUESTS pseudo-requests; the fleet's
    alone without own rounds, the segment's alone without the fleet's; 0 when neither is known."""
    n, mid = total(own), median(own)
    if not (n > 0 and mid > 0):
        return fleet_seconds if _positive(fleet_seconds) else 0.0
    if not _positive(fleet_seconds):
        return mid
    weight = REFERENCE_PRIOR_REQUESTS
    return math.exp((n * math.log(mid) + weight * math.log(fleet_seconds)) / (n + weight))


@dataclass(frozen=True)
class Realised:
    """A plan's realised speedup in a segment: its log, the log's standard error, and the requests behind it."""

    log_speedup: float
    log_se: float
    requests: float

    @property
    def speedup(self) -> float:
        return math.exp(self.log_speedup)


def realised(plan: Histogram, own_plain: Histogram, fleet_seconds: float) -> Realised | None:
    """The plan's realised speedup (``plan``: its requests by seconds per emitted token) at the segment's reference;
    None below MIN_REQUESTS requests or without a reference."""
    n = total(plan)
    reference = plain_reference(own_plain, fleet_seconds)
    mid = median(plan)
    if not (n >= MIN_REQUESTS and mid > 0 and reference > 0):
        return None
    log_speedup = math.log(reference) - math.log(mid)
    if not abs(log_speedup) <= MAX_LOG:
        return None
    spread = (quantile(plan, 0.75) - quantile(plan, 0.25)) / 1.349 / mid
    plan_se = 1.2533 * max(spread, REQUEST_LOG_SD) / math.sqrt(n)
    reference_se = REQUEST_LOG_SD / math.sqrt(total(own_plain) + REFERENCE_PRIOR_REQUESTS)
    return Realised(log_speedup, math.hypot(plan_se, reference_se), n)


@dataclass(frozen=True)
class Posterior:
    """The log speedup of a plan, as a normal: its mean and standard deviation."""

    mean_log: float
    sd_log: float

    @property
    def speedup(self) -> float:
        """The expected speedup a decision promises (the posterior's median)."""
        return math.exp(self.mean_log)

    def lower(self, z: float = LOWER_Z) -> float:
        """The lower credible bound plans are ranked by."""
        return math.exp(self.mean_log - z * self.sd_log)


def posterior(model_speedup: float, data: Realised | None, model_sd: float = MODEL_LOG_SD) -> Posterior:
    """The model's speedup as the prior (log mean, ``model_sd``), updated with what the plan realised. A model
    speedup that is not a positive number counts as 1 (no gain)."""
    prior_mean = math.log(model_speedup) if _positive(model_speedup) and math.isfinite(model_speedup) else 0.0
    prior_mean = min(max(prior_mean, -MAX_LOG), MAX_LOG)
    if data is None or not data.log_se > 0:
        return Posterior(prior_mean, model_sd)
    prior_precision, data_precision = 1.0 / model_sd**2, 1.0 / data.log_se**2
    precision = prior_precision + data_precision
    mean = (prior_precision * prior_mean + data_precision * data.log_speedup) / precision
    return Posterior(mean, 1.0 / math.sqrt(precision))


def _positive(x: float) -> bool:
    return math.isfinite(x) and x > 0
