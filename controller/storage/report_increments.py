"""What one report adds to Redis: its aggregates' increments summed per hash field, in one pass. Pure.

An aggregate's own increments are ``Aggregate.segment_fields``, ``calibration_fields`` and ``cost_fields``
(counts.py). A report holds up to MAX_AGGREGATES of them over a few segments, and what they add to one hash is their
sum; so the store writes each field of a hash once, with the report's total, instead of once per aggregate (a report
at the bounds: 1,000 aggregates at K 32 over 16 segments are 2,200 HINCRBYFLOATs, not 134,000, and no per-aggregate
dictionary of 134 names is built). The result is the sum of those per-aggregate fields, with the fields whose sum is
0 left out (tests/controller/test_report_increments.py holds the two together); counts are integers and add up
exactly, seconds in the order of the report, as Redis would have added them (up to its rounding).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, zip_longest
from operator import truediv

from controller.decision.counts import Aggregate
from controller.decision.timing_histogram import bin_of, count_bins
from controller.pacing import no_pause
from controller.storage import redis_schema as schema
from specd_api.modes import Mode
from specd_api.plan import batch_bucket

StepSeconds = Callable[[str, int], float]  # a plain step's seconds in a segment at a batch size (0: not known)


def segment_increments(
    aggregates: Iterable[Aggregate], step_seconds: StepSeconds | None = None, pace: Callable[[], None] = no_pause
) -> dict[str, dict[str, float]]:
    """Segment -> the increments of that segment's bucket hash: the sum of ``segment_fields()`` (and, with
    ``step_seconds``, ``calibration_fields``) over the aggregates of that segment, nonzero fields only. Every segment
    of ``aggregates`` has an entry, empty when nothing is added (a worker's start-up timings)."""
    by_segment: dict[str, list[Aggregate]] = {}
    for a in aggregates:
        by_segment.setdefault(a.segment, []).append(a)
    increments = {}
    for segment, group in by_segment.items():
        pace()  # between segments (pacing.py)
        increments[segment] = _one_segment(segment, group, step_seconds)
    return increments


def _one_segment(segment: str, aggregates: Sequence[Aggregate], step_seconds: StepSeconds | None) -> dict[str, float]:
    k_sums: dict[tuple[str, int], list[float]] = {}  # (drafter, K) -> K_COUNTERS' sums
    position_groups: dict[tuple[str, bool], list[Aggregate]] = {}  # (drafter, counterfactual) -> its aggregates
    observations: Counter[str] = Counter()  # histogram fields (st|, sp|, cal|): one observation per aggregate
    steps: dict[int, float] = {}  # batch size -> step_seconds(segment, batch size), asked once each
    for a in aggregates:
        if not a.start_up_timings:
            if not a.counterfactual:
                sums = k_sums.setdefault((a.drafter, a.k), [0, 0, 0, 0, 0.0, 0.0])
                sums[0] += a.rounds
                sums[1] += a.num_drafted
                sums[2] += a.num_accepted
                sums[3] += a.tokens_emitted
                sums[4] += a.draft_seconds
                sums[5] += a.verify_seconds
                if a.by_drafted and a.by_drafted[0][0]:
                    rounds, seconds = a.by_drafted[0]
                    step_bin = bin_of(seconds / rounds)
                    if step_bin is not None:
                        observations[schema.plain_step_field(batch_bucket(a.batch_size), step_bin)] += 1
                realised_bin = bin_of(a.seconds_per_token) if a.drafter != "none" else None
                if realised_bin is not None:
                    observations[schema.realised_field(a.drafter, batch_bucket(a.batch_size), realised_bin)] += 1
            if a.k:
                position_groups.setdefault((a.drafter, a.counterfactual), []).append(a)
        if step_seconds is not None and a.drafter != "none" and a.expected_speedup > 0:
            if a.batch_size not in steps:
                steps[a.batch_size] = step_seconds(segment, a.batch_size)
            observations.update(a.calibration_fields(steps[a.batch_size]).keys())
    fields: dict[str, float] = {}
    for (drafter, k), sums in k_sums.items():
        fields.update(zip(schema.k_fields(drafter, k), map(float, sums), strict=True))
    for (drafter, counterfactual), group in position_groups.items():
        for i, values in enumerate(_position_sums(group)):
            fields.update(zip(schema.position_fields(drafter, i, counterfactual), map(float, values), strict=True))
    fields.update((name, float(n)) for name, n in observations.items())
    return {name: value for name, value in fields.items() if value}


def _position_sums(aggregates: Sequence[Aggregate]) -> zip[tuple[int, int, int, int]]:
    """(offered, proposed, verified, accepted) summed over ``aggregates``, per draft position 0.. up to the largest
    K: position i counts the rounds of the aggregates with K > i. Columns are summed in C (zip_longest, sum)."""
    width = max(a.k for a in aggregates)
    rounds_at_k = [0] * (width + 1)
    for a in aggregates:
        rounds_at_k[a.k] += a.rounds
    offered, running = [0] * width, 0
    for i in reversed(range(width)):
        running += rounds_at_k[i + 1]
        offered[i] = running
    return zip(
        offered,
        _column_sums([_within_k(a.proposed_per_position, a.k) for a in aggregates], width),
        _column_sums([_within_k(a.verified_per_position, a.k) for a in aggregates], width),
        _column_sums([_within_k(a.accepted_per_position, a.k) for a in aggregates], width),
        strict=True,
    )


def _within_k(values: tuple[int, ...], k: int) -> tuple[int, ...]:
    return values if len(values) <= k else values[:k]  # validation refuses more; an Aggregate built in code may not


def _column_sums(rows: list[tuple[int, ...]], width: int) -> list[int]:
    sums = [sum(column) for column in zip_longest(*rows, fillvalue=0)]
    return sums + [0] * (width - len(sums))


def cost_increments(aggregates: Iterable[Aggregate], pace: Callable[[], None] = no_pause) -> dict[str, float]:
    """The increments of the cost bucket hash: the sum of ``cost_fields()`` over ``aggregates``, in their order,
    nonzero fields only. The per-n verification timings (up to MAX_REPORT_POSITIONS + MAX_AGGREGATES of them in a
    report) are summed by column, n by n, in C. ``pace`` is called between aggregates and columns (pacing.py)."""
    draft: dict[tuple[str, int, Mode], list[float]] = {}  # (drafter, bucket, mode) -> [seconds, tokens drafted]
    by_drafted: dict[tuple[int, Mode], list[tuple[tuple[int, float], ...]]] = {}  # each aggregate's (rounds, s)
    observations: Counter[str] = Counter()  # he| fields: one observation per aggregate
    for a in aggregates:
        pace()
        if a.counterfactual or a.totals_only or not a.rounds:
            continue
        bucket, mode = batch_bucket(a.batch_size), a.mode
        if a.drafter != "none" and a.num_drafted:
            sums = draft.setdefault((a.drafter, bucket, mode), [0.0, 0.0])
            sums[0] += a.draft_seconds
            sums[1] += a.num_drafted
            b = bin_of(a.draft_seconds / a.num_drafted)
            if b is not None:
                observations[schema.draft_hist_field(a.drafter, bucket, b, mode)] += 1
        by_drafted.setdefault((bucket, mode), []).append(a.by_drafted)
    fields: dict[str, float] = {}
    for (drafter, bucket, mode), (draft_seconds, drafted) in draft.items():
        fields[schema.draft_cost_field(drafter, bucket, "s", mode)] = draft_seconds
        fields[schema.draft_cost_field(drafter, bucket, "n", mode)] = float(drafted)
    fields.update((name, float(n)) for name, n in observations.items())
    for (bucket, mode), rows in by_drafted.items():
        for n, column in enumerate(zip_longest(*rows, fillvalue=(0, 0.0))):
            pace()
            # each aggregate's (rounds, seconds) at n, in order; one with no rounds at n adds nothing
            rounds, seconds = zip(*column, strict=True)
            fields[schema.verify_cost_field(n, bucket, "s", mode)] = sum(compress(seconds, rounds))
            fields[schema.verify_cost_field(n, bucket, "r", mode)] = float(sum(rounds))
            # one observation per aggregate that verified n: its seconds per round
            for b, count in count_bins(map(truediv, compress(seconds, rounds), filter(None, rounds))).items():
                fields[schema.verify_hist_field(n, bucket, b, mode)] = float(count)
    return {name: value for name, value in fields.items() if value}
