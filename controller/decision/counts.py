"""What the controller learns, as plain counts: per segment × drafter × K × draft position, and costs.

Counts live in Redis as hash fields (redis_schema.py names them). These classes add up the fields' values with
decay weights and derive rates; an Aggregate says what one report adds. Everything here is pure.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from controller.decision.timing_histogram import add_into, bin_of
from controller.storage import redis_schema as schema
from specd_api.modes import Mode, sampling_mode
from specd_api.plan import batch_bucket


@dataclass
class KCounts:
    """One drafter at one K in one segment."""

    rounds: float = 0.0
    proposed: float = 0.0
    accepted: float = 0.0
    tokens: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0


@dataclass
class PositionCounts:
    """One drafter at one draft position, pooled over K (a position's acceptance does not depend on K)."""

    offered: float = 0.0  # rounds with K > i
    proposed: float = 0.0  # ... whose proposal reached position i
    verified: float = 0.0  # ... with every earlier position accepted
    accepted: float = 0.0

    def plus(self, other: PositionCounts) -> PositionCounts:
        return PositionCounts(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


@dataclass
class SegmentCounts:
    by_k: dict[tuple[str, int], KCounts] = field(default_factory=lambda: defaultdict(KCounts))
    positions: dict[tuple[str, int], PositionCounts] = field(default_factory=lambda: defaultdict(PositionCounts))
    # Counterfactual rounds (scored from the emitted tokens while another drafter ran), per drafter and position.
    counterfactual: dict[tuple[str, int], PositionCounts] = field(default_factory=lambda: defaultdict(PositionCounts))
    # drafter -> bin -> requests whose realised / expected speedup fell there (Aggregate.calibration_fields)
    calibration: dict[str, dict[int, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    # batch bucket -> bin -> requests whose plain steps took that long: the segment's own plain pace (its contexts)
    plain_step: dict[int, dict[int, float]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(float)))
    # (drafter, batch bucket) -> bin -> requests that speculated with it, by seconds per emitted token: what plans
    # realised here (controller/decision/realised.py reads them against plain_step)
    realised: dict[tuple[str, int], dict[int, float]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(float))
    )
    last_update: float = 0.0

    @property
    def rounds(self) -> float:
        return sum(c.rounds for c in self.by_k.values())

    @property
    def empty(self) -> bool:
        """Nothing counted: what a segment no report has named holds (every such segment decides alike)."""
        return not (
            self.by_k or self.positions or self.counterfactual or self.calibration or self.plain_step or self.realised
        )

    def drafters(self) -> list[str]:
        keys = [*self.by_k, *self.positions, *self.counterfactual]
        return sorted({d for d, _ in keys})

    def position_list(self, drafter: str, counterfactual: bool = False) -> list[PositionCounts]:
        """Positions 0.. of ``drafter`` in order (missing positions are zero counts)."""
        table = self.counterfactual if counterfactual else self.positions
        known = [i for d, i in table if d == drafter]
        return [table.get((drafter, i), PositionCounts()) for i in range(max(known, default=-1) + 1)]

    def evidence(self, drafter: str, i: int) -> PositionCounts:
        """What a position's acceptance is estimated from: served and counterfactual rounds together."""
        return self.positions.get((drafter, i), PositionCounts()).plus(
            self.counterfactual.get((drafter, i), PositionCounts())
        )

    def add(self, other: SegmentCounts) -> None:
        for key, k in other.by_k.items():
            _add_dataclass(self.by_k[key], k)
        for key, p in other.positions.items():
            _add_dataclass(self.positions[key], p)
        for key, p in other.counterfactual.items():
            _add_dataclass(self.counterfactual[key], p)
        _add_histograms(self.calibration, other.calibration)
        _add_histograms(self.plain_step, other.plain_step)
        _add_histograms(self.realised, other.realised)
        self.last_update = max(self.last_update, other.last_update)

    def add_fields(self, values: Mapping[str, float], weight: float = 1.0) -> None:
        """Add a bucket's hash fields, scaled by ``weight`` (the decay of the bucket's age). A field the schema does
        not know (a newer schema's, or corrupt) is ignored: stored data never breaks a read. A bucket's counters of
        one position (or one K) are made consistent before they count (``consistent``): a hand-edited or corrupt
        bucket with more proposals than offers never makes a rate above 1 or a Beta with negative failures."""
        self._add(values, weight, _number)

    def _add(self, values: Mapping[str, float], weight: float, number: Callable[[object], float]) -> None:
        """``add_fields``, each value read by ``number``."""
        # this bucket's counters per (table, drafter, index), in the dataclasses' field order, before they count
        bucket: dict[tuple[int, str, int], list[float]] = {}
        for name, value in values.items():
            f = schema.segment_field(name)
            if isinstance(f, schema.KField):
                key, slot = (K_TABLE, f.drafter, f.k), K_SLOTS[f.counter]
            elif isinstance(f, schema.PositionField):
                key = (SCORED_TABLE if f.counterfactual else SERVED_TABLE, f.drafter, f.position)
                slot = POSITION_SLOTS[f.counter]
            elif isinstance(f, schema.CalibrationField):
                self.calibration[f.drafter][f.bin] += weight * number(value)
                continue
            elif isinstance(f, schema.PlainStepField):
                self.plain_step[f.batch_bucket][f.bin] += weight * number(value)
                continue
            elif isinstance(f, schema.RealisedField):
                self.realised[(f.drafter, f.batch_bucket)][f.bin] += weight * number(value)
                continue
            elif isinstance(f, schema.UpdatedField):
                with contextlib.suppress(ValueError):  # not a time: ignored
                    self.last_update = max(self.last_update, float(value))
                continue
            else:
                continue  # a field the schema does not read
            counters = bucket.get(key)
            if counters is None:
                counters = bucket[key] = [0.0] * (len(K_SLOTS) if key[0] == K_TABLE else len(POSITION_SLOTS))
            counters[slot] += number(value)
        tables = (self.by_k, self.positions, self.counterfactual)
        for (table, drafter, i), counters in bucket.items():
            consistent(counters, table == K_TABLE)
            into = tables[table][(drafter, i)]
            for name, v in zip(K_SLOTS if table == K_TABLE else POSITION_SLOTS, counters, strict=True):
                if v:
                    setattr(into, name, getattr(into, name) + weight * v)

    def add_buckets(self, buckets: Iterable[tuple[Mapping[str, float], float]]) -> None:
        """Add buckets' fields, each scaled by its weight, in one pass: their weighted values summed per field name,
        then read as one bucket. Equal, bit for bit, to ``add_fields`` of each in turn when every bucket is clean
        (``clean_bucket``: the store cleans each as it reads it), since the same products are added in the same
        order (sums of clean buckets stay consistent: rounding is monotone); a window's recount then reads each field
        name once, not once a bucket."""
        merged: dict[str, float] = {}
        get = merged.get
        for values, weight in buckets:
            for name, value in values.items():
                merged[name] = get(name, 0.0) + weight * value
            updated = values.get(schema.UPDATED)
            if updated is not None:
                self.last_update = max(self.last_update, updated)
        merged.pop(schema.UPDATED, None)
        self._add(merged, 1.0, float)  # type: ignore[arg-type]


def clean_bucket(values: dict[str, float]) -> dict[str, float]:
    """A segment bucket's fields as ``add_fields`` counts them, so that weighted sums of clean buckets count as the
    buckets one by one (``add_buckets``): each counter under its one name (``schema.field_name``: two names the schema
    reads as one counter, "01" and "1", summed under it), a usable number (``_number``), and each position's or K's
    counters consistent (``consistent``); a field the schema does not read, and the update time, kept as they are.
    ``values`` itself when it is clean (what a worker writes always is), else a cleaned copy."""
    parsed = [(name, value, schema.segment_field(name)) for name, value in values.items()]
    if any(
        f is not None and f is not schema.UPDATED_FIELD and (_number(v) != v or schema.field_name(f) != name)
        for name, v, f in parsed
    ):  # the counters summed under their one name, as add_fields sums them, in the same order
        cleaned: dict[str, float] = {}
        for name, value, f in parsed:
            if f is None or f is schema.UPDATED_FIELD:
                cleaned[name] = value
            else:
                canonical = schema.field_name(f)
                cleaned[canonical] = cleaned.get(canonical, 0.0) + _number(value)
        parsed = [(name, value, schema.segment_field(name)) for name, value in cleaned.items()]
    else:
        cleaned = values
    groups: dict[tuple[int, str, int], list[tuple[str, int]]] = {}  # (table, drafter, index) -> (name, slot)
    for name, _, f in parsed:
        if isinstance(f, schema.KField):
            groups.setdefault((K_TABLE, f.drafter, f.k), []).append((name, K_SLOTS[f.counter]))
        elif isinstance(f, schema.PositionField):
            key = (SCORED_TABLE if f.counterfactual else SERVED_TABLE, f.drafter, f.position)
            groups.setdefault(key, []).append((name, POSITION_SLOTS[f.counter]))
    for (table, _, _), names in groups.items():
        counters = [0.0] * (len(K_SLOTS) if table == K_TABLE else len(POSITION_SLOTS))
        for name, slot in names:
            counters[slot] = cleaned[name]
        consistent(counters, table == K_TABLE)
        for name, slot in names:
            if cleaned[name] != counters[slot]:
                if cleaned is values:
                    cleaned = dict(values)
                cleaned[name] = counters[slot]
    return cleaned


K_TABLE, SERVED_TABLE, SCORED_TABLE = 0, 1, 2
K_SLOTS = {f.name: i for i, f in enumerate(fields(KCounts))}
POSITION_SLOTS = {f.name: i for i, f in enumerate(fields(PositionCounts))}
_OFFERED, _PROPOSED, _VERIFIED, _ACCEPTED = (POSITION_SLOTS[n] for n in ("offered", "proposed", "verified", "accepted"))
_K_PROPOSED, _K_ACCEPTED = K_SLOTS["proposed"], K_SLOTS["accepted"]


def consistent(counters: list[float], of_k: bool) -> None:
    """One bucket's counters (in the order of KCounts' or PositionCounts' fields) cut down to what a report can
    write: of a position, accepted <= verified and proposed <= offered; of a K, accepted <= proposed. Every report
    keeps these (a token is accepted only once verified, proposed only where offered), so they change nothing a worker
    wrote; corrupt data is cut down to them."""
    if of_k:
        counters[_K_ACCEPTED] = min(counters[_K_ACCEPTED], counters[_K_PROPOSED])
    else:
        counters[_PROPOSED] = min(counters[_PROPOSED], counters[_OFFERED])
        counters[_ACCEPTED] = min(counters[_ACCEPTED], counters[_VERIFIED])


def _histograms() -> defaultdict[tuple[object, int], defaultdict[int, float]]:
    return defaultdict(lambda: defaultdict(float))


@dataclass
class CostCounts:
    """Measured costs over all segments, per sampling mode and batch bucket: drafting time per drafter, verification
    time per number of tokens drafted in the round (n); as sums, and as histograms of per-request timings
    (timing_histogram.py), which the costs are read from where they exist (a minority of stalled requests cannot
    move their median)."""

    # (drafter, bucket, mode)
    draft_s: dict[tuple[str, int, Mode], float] = field(default_factory=lambda: defaultdict(float))
    drafted: dict[tuple[str, int, Mode], float] = field(default_factory=lambda: defaultdict(float))
    # (n, bucket, mode)
    verify_s: dict[tuple[int, int, Mode], float] = field(default_factory=lambda: defaultdict(float))
    verify_rounds: dict[tuple[int, int, Mode], float] = field(default_factory=lambda: defaultdict(float))
    # (drafter, bucket, mode) -> bin -> requests whose drafting took that many seconds per drafted token
    draft_hist: dict[tuple[str, int, Mode], dict[int, float]] = field(default_factory=_histograms)  # type: ignore[arg-type]
    # (n, bucket, mode) -> bin -> requests whose rounds that drafted n took that many seconds each (their mean)
    verify_hist: dict[tuple[int, int, Mode], dict[int, float]] = field(default_factory=_histograms)  # type: ignore[arg-type]

    def add(self, other: CostCounts) -> None:
        for mine, theirs in (
            (self.draft_s, other.draft_s),
            (self.drafted, other.drafted),
            (self.verify_s, other.verify_s),
            (self.verify_rounds, other.verify_rounds),
        ):
            for key, value in theirs.items():
                mine[key] += value  # type: ignore[index]
        for mine_h, theirs_h in ((self.draft_hist, other.draft_hist), (self.verify_hist, other.verify_hist)):
            for key, hist in theirs_h.items():
                into = mine_h[key]  # type: ignore[index]
                for b, w in hist.items():
                    into[b] += w

    def add_fields(self, values: Mapping[str, float], weight: float = 1.0) -> None:
        """Add a cost bucket's hash fields, scaled by ``weight``; a field the schema does not know is ignored."""
        for name, value in values.items():
            f = schema.cost_field(name)
            if f is None:
                continue
            v = weight * _number(value)
            if isinstance(f, schema.DraftHistField):
                self.draft_hist[(f.drafter, f.batch_bucket, f.mode)][f.bin] += v
            elif isinstance(f, schema.VerifyHistField):
                self.verify_hist[(f.n, f.batch_bucket, f.mode)][f.bin] += v
            elif isinstance(f, schema.DraftCostField):
                (self.draft_s if f.quantity == "s" else self.drafted)[(f.drafter, f.batch_bucket, f.mode)] += v
            else:
                (self.verify_s if f.quantity == "s" else self.verify_rounds)[(f.n, f.batch_bucket, f.mode)] += v


def _add_histograms(into: dict[Any, dict[int, float]], other: Mapping[Any, Mapping[int, float]]) -> None:
    for key, hist in other.items():
        add_into(into[key], hist)


def _add_dataclass(into: KCounts | PositionCounts, other: KCounts | PositionCounts) -> None:
    for f in fields(other):
        setattr(into, f.name, getattr(into, f.name) + getattr(other, f.name))


# No counter a worker writes comes near this (a million rounds a second for 30 years); past it a value is corrupt and
# counts as 0, so a few of them (1e308) added up never overflow to inf and make every rate of the segment NaN.
MAX_STORED_COUNT = 1e15


def _number(value: object) -> float:
    """A stored counter as a usable number: anything negative, past MAX_STORED_COUNT, infinite or not a number
    counts as 0."""
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return x if 0 <= x <= MAX_STORED_COUNT else 0.0  # NaN fails the comparison


def decay_weight(age_seconds: float, half_life_seconds: float) -> float:
    return 0.5 ** (max(age_seconds, 0.0) / half_life_seconds)


@dataclass(frozen=True)
class Aggregate:
    """Rounds of one request (or interval) with one drafter and one K: a validated RoundsAggregate, its fields under
    the message's names (``by_drafted`` pairs the message's rounds_by_drafted and verify_seconds_by_drafted)."""

    segment: str
    drafter: str
    k: int  # the K the rounds ran with
    rounds: int
    num_drafted: int
    num_accepted: int
    proposed_per_position: tuple[int, ...]
    verified_per_position: tuple[int, ...]
    accepted_per_position: tuple[int, ...]
    tokens_emitted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    batch_size: int = 1
    temperature: float = 0.0
    prompt_tokens: int = 0
    self_repetition: float = 0.0
    by_drafted: tuple[tuple[int, float], ...] = ()  # (rounds, verify seconds) per number drafted n = 0..
    counterfactual: bool = False  # scored, not served: position counts only
    expected_speedup: float = 0.0  # what the plan promised (0: not known)
    start_up_timings: bool = False  # measured by the worker before serving: costs only, in no segment
    request_tokens_emitted: int = 0  # the whole request's, on its calibration carrier (0: not sent, its own rounds)
    request_seconds: float = 0.0
    totals_only: bool = False  # an engine's request totals: positions inferred (decision/totals.py), no costs

    @property
    def mode(self) -> Mode:
        """The sampling mode of the request's rounds."""
        return sampling_mode(self.temperature)

    @property
    def seconds_per_token(self) -> float:
        """The request's every round's seconds over its every emitted token, on the aggregate that carries its
        totals (0 elsewhere): what the plan realised, in the frame plain decoding is timed in (a plain step is the
        seconds of one token)."""
        if self.counterfactual or not self.request_tokens_emitted or not self.request_seconds > 0:
            return 0.0
        value = self.request_seconds / self.request_tokens_emitted
        return value if math.isfinite(value) else 0.0

    def realised_speedup(self, step_seconds: float) -> float:
        """Tokens emitted per plain step's worth of time (drafting and verification), the request's when the
        aggregate carries its totals, else its own: the speedup over plain decoding at ``step_seconds`` a step; 0
        when not measurable."""
        tokens, seconds = self.tokens_emitted, self.draft_seconds + self.verify_seconds
        if self.request_tokens_emitted and self.request_seconds > 0:
            tokens, seconds = self.request_tokens_emitted, self.request_seconds
        if self.counterfactual or not tokens or not (seconds > 0 and step_seconds > 0):
            return 0.0
        value = tokens * step_seconds / seconds
        return value if math.isfinite(value) else 0.0

    def calibration_fields(self, step_seconds: float) -> dict[str, float]:
        """The segment-hash increment recording realised / expected speedup (one observation of a histogram, read
        as its median: one stalled request is one rank), when both are known."""
        if self.drafter == "none" or not self.expected_speedup > 0:
            return {}
        b = bin_of(self.realised_speedup(step_seconds) / self.expected_speedup)
        return {} if b is None else {schema.calibration_field(self.drafter, b): 1.0}

    def segment_fields(self) -> dict[str, float]:
        """Increments for the segment's bucket hash."""
        d, k = self.drafter, self.k
        fields: dict[str, float] = {}
        if self.start_up_timings:
            return fields
        if not self.counterfactual:
            fields |= {
                schema.k_field(d, k, "rounds"): self.rounds,
                schema.k_field(d, k, "proposed"): self.num_drafted,
                schema.k_field(d, k, "accepted"): self.num_accepted,
                schema.k_field(d, k, "tokens"): self.tokens_emitted,
                schema.k_field(d, k, "draft_s"): self.draft_seconds,
                schema.k_field(d, k, "verify_s"): self.verify_seconds,
            }
        plain = self.by_drafted[0] if self.by_drafted and not self.counterfactual else (0, 0.0)
        step_bin = bin_of(plain[1] / plain[0]) if plain[0] else None
        if step_bin is not None:
            fields[schema.plain_step_field(batch_bucket(self.batch_size), step_bin)] = 1.0
        realised_bin = bin_of(self.seconds_per_token) if d != "none" else None
        if realised_bin is not None:
            fields[schema.realised_field(d, batch_bucket(self.batch_size), realised_bin)] = 1.0
        scored = self.counterfactual
        for i in range(k):
            fields[schema.position_field(d, i, "offered", scored)] = self.rounds
            fields[schema.position_field(d, i, "proposed", scored)] = _at(self.proposed_per_position, i)
            fields[schema.position_field(d, i, "verified", scored)] = _at(self.verified_per_position, i)
            fields[schema.position_field(d, i, "accepted", scored)] = _at(self.accepted_per_position, i)
        return {name: float(v) for name, v in fields.items()}

    def cost_fields(self) -> dict[str, float]:
        """Increments for the global cost hash: drafting time per drafted token and verification time per n, both
        in the batch bucket the rounds ran in and under their sampling mode."""
        if self.counterfactual or self.totals_only or not self.rounds:
            return {}
        bucket, mode = batch_bucket(self.batch_size), self.mode
        fields: dict[str, float] = {}
        if self.drafter != "none" and self.num_drafted:
            fields[schema.draft_cost_field(self.drafter, bucket, "s", mode)] = self.draft_seconds
            fields[schema.draft_cost_field(self.drafter, bucket, "n", mode)] = float(self.num_drafted)
            b = bin_of(self.draft_seconds / self.num_drafted)
            if b is not None:
                fields[schema.draft_hist_field(self.drafter, bucket, b, mode)] = 1.0  # one request, one observation
        for n, (rounds, seconds) in enumerate(self.by_drafted):
            if rounds:
                fields[schema.verify_cost_field(n, bucket, "s", mode)] = seconds
                fields[schema.verify_cost_field(n, bucket, "r", mode)] = float(rounds)
                b = bin_of(seconds / rounds)
                if b is not None:
                    fields[schema.verify_hist_field(n, bucket, b, mode)] = 1.0
        return fields


def _at(values: tuple[int, ...], i: int) -> int:
    return values[i] if i < len(values) else 0
