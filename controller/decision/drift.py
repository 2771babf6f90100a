"""The α drift alarm: has a segment's acceptance left its long-run band? Pure.

A two-sided Page-Hinkley test on the first draft position's counts, bucket by bucket in time order (position 0 is
verified on every round that proposed anything, whatever K, so its rate does not move when K does). Each verified
token is a trial; with x̄ the running acceptance rate up to and including a bucket,

    down:  m_t = Σ (accepted - verified · (x̄ - δ)),   alarm when max_{s≤t} m_s - m_t > λ
    up:    u_t = Σ (accepted - verified · (x̄ + δ)),   alarm when u_t - min_{s≤t} u_s > λ

δ is the change too small to care about and λ the evidence needed, both in trials. The change is taken to start
after the bucket where the statistic last had its extreme. Under steady traffic the statistic drifts away from
its extreme by δ per trial, so false alarms need a run of bad luck of about λ / δ trials.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specd_api.speedup import ratio

DELTA = 0.05  # acceptance changes smaller than this are not drift
LAMBDA = 20.0  # trials of evidence before an alarm


@dataclass(frozen=True)
class Drift:
    direction: str  # "down" | "up"
    since_bucket: int  # the first bucket of the new regime
    alpha_before: float
    alpha_since: float


def page_hinkley(
    series: Sequence[tuple[int, float, float]], delta: float = DELTA, threshold: float = LAMBDA
) -> Drift | None:
    """The first change in ``series`` = [(bucket, accepted, verified)] (time order), or None when it is steady."""
    accepted_sum = verified_sum = 0.0
    down = up = 0.0
    down_peak = up_trough = 0.0
    down_at = up_at = -1  # index of the bucket after which each statistic had its extreme
    for index, (_, accepted, verified) in enumerate(series):
        if verified <= 0:
            continue
        accepted_sum += accepted
        verified_sum += verified
        mean = accepted_sum / verified_sum
        down += accepted - verified * (mean - delta)
        up += accepted - verified * (mean + delta)
        if down >= down_peak:
            down_peak, down_at = down, index
        if up <= up_trough:
            up_trough, up_at = up, index
        if down_peak - down > threshold:
            return _drift("down", series, down_at + 1)
        if up - up_trough > threshold:
            return _drift("up", series, up_at + 1)
    return None


def _drift(direction: str, series: Sequence[tuple[int, float, float]], split: int) -> Drift:
    before, since = series[:split], series[split:]
    return Drift(
        direction=direction,
        since_bucket=series[split][0] if split < len(series) else series[-1][0],
        alpha_before=ratio(sum(a for _, a, _ in before), sum(v for _, _, v in before)),
        alpha_since=ratio(sum(a for _, a, _ in since), sum(v for _, _, v in since)),
    )
