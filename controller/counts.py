"""What the controller learns, as plain counts: per segment × drafter × K × draft position, and costs.

Counts live in Redis as hash fields (see store.py for the key schema). These classes parse those fields,
add them up with decay weights, and derive rates. Everything here is pure.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from controller.timing_histogram import MAX_BIN, MIN_BIN, bin_of
from specd_api.checks import MAX_K
from specd_api.plan import batch_bucket

# Field names inside a segment bucket hash (K-level and position-level counters).
K_FIELDS = ("rounds", "proposed", "accepted", "tokens", "draft_s", "verify_s")
POSITION_FIELDS = ("offered", "proposed", "verified", "accepted")
SERVED, COUNTERFACTUAL = "p", "q"  # position fields of served rounds, and of counterfactually scored ones
# Cost histogram fields (timing_histogram.py): he|{drafter}|{batch bucket}|{bin}, hw|{n}|{batch bucket}|{bin}.
DRAFT_HIST, VERIFY_HIST = "he", "hw"
CALIBRATION = "cal"  # cal|{drafter}|{bin}: requests whose realised / expected speedup fell in that bin
PLAIN_STEP = "st"  # st|{batch bucket}|{bin}: requests whose plain rounds (n = 0) took that many seconds each


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
    last_update: float = 0.0

    @property
    def rounds(self) -> float:
        return sum(c.rounds for c in self.by_k.values())

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
        self.last_update = max(self.last_update, other.last_update)

    def add_fields(self, values: Mapping[str, float], weight: float = 1.0) -> None:
        """Add a bucket's hash fields, scaled by ``weight`` (the decay of the bucket's age)."""
        for name, value in values.items():
            parts = name.split("|")
            try:
                if parts[0] == "k" and len(parts) == 4 and parts[3] in K_FIELDS:
                    if not 0 <= int(parts[2]) <= MAX_K:
                        continue  # no round has such a K: a corrupt field (it would size every table read from it)
                    target: KCounts | PositionCounts = self.by_k[(parts[1], int(parts[2]))]
                elif parts[0] in (SERVED, COUNTERFACTUAL) and len(parts) == 4 and parts[3] in POSITION_FIELDS:
                    if not 0 <= int(parts[2]) < MAX_K:
                        continue  # a draft position past any K: corrupt (position 3,000,000 cost 7.7 s a read)
                    table = self.positions if parts[0] == SERVED else self.counterfactual
                    target = table[(parts[1], int(parts[2]))]
                elif parts[0] in (CALIBRATION, PLAIN_STEP) and len(parts) == 3:
                    b = int(parts[2])
                    if MIN_BIN <= b <= MAX_BIN:
                        if parts[0] == CALIBRATION:
                            self.calibration[parts[1]][b] += weight * _number(value)
                        else:
                            self.plain_step[int(parts[1])][b] += weight * _number(value)
                    continue
                elif name == "updated":
                    self.last_update = max(self.last_update, float(value))
                    continue
                else:
                    continue  # a field of a newer schema: ignore rather than fail
            except ValueError:
                continue  # a corrupt field name: ignore it (stored data never breaks a read)
            setattr(target, parts[3], getattr(target, parts[3]) + weight * _number(value))


def _histograms() -> defaultdict[tuple[object, int], defaultdict[int, float]]:
    return defaultdict(lambda: defaultdict(float))


@dataclass
class CostCounts:
    """Measured costs over all segments, per batch bucket: drafting time per drafter, verification time per number
    of tokens drafted in the round (n); as sums, and as histograms of per-request timings (timing_histogram.py),
    which the costs are read from where they exist (a minority of stalled requests cannot move their median)."""

    draft_s: dict[tuple[str, int], float] = field(default_factory=lambda: defaultdict(float))  # (drafter, bucket)
    drafted: dict[tuple[str, int], float] = field(default_factory=lambda: defaultdict(float))
    verify_s: dict[tuple[int, int], float] = field(default_factory=lambda: defaultdict(float))  # (n, bucket)
    verify_rounds: dict[tuple[int, int], float] = field(default_factory=lambda: defaultdict(float))
    # (drafter, bucket) -> bin -> requests whose drafting took that many seconds per drafted token
    draft_hist: dict[tuple[str, int], dict[int, float]] = field(default_factory=_histograms)  # type: ignore[arg-type]
    # (n, bucket) -> bin -> requests whose rounds that drafted n took that many seconds each (their mean)
    verify_hist: dict[tuple[int, int], dict[int, float]] = field(default_factory=_histograms)  # type: ignore[arg-type]

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
        for name, value in values.items():
            parts = name.split("|")
            try:
                v = weight * _number(value)
                if len(parts) == 4 and parts[0] in (DRAFT_HIST, VERIFY_HIST):
                    b = int(parts[3])
                    if not MIN_BIN <= b <= MAX_BIN:
                        continue  # no real timing lies there: a corrupt field
                    if parts[0] == DRAFT_HIST:
                        self.draft_hist[(parts[1], int(parts[2]))][b] += v
                    elif 0 <= int(parts[1]) <= MAX_K:
                        self.verify_hist[(int(parts[1]), int(parts[2]))][b] += v
                    continue
                if len(parts) != 4 or parts[0] not in ("e", "w"):
                    continue  # another schema's field (the earlier d|/v| fields mixed round lengths): ignore
                if parts[0] == "e" and parts[3] in ("s", "n"):
                    (self.draft_s if parts[3] == "s" else self.drafted)[(parts[1], int(parts[2]))] += v
                elif parts[0] == "w" and parts[3] in ("s", "r") and 0 <= int(parts[1]) <= MAX_K:
                    (self.verify_s if parts[3] == "s" else self.verify_rounds)[(int(parts[1]), int(parts[2]))] += v
            except ValueError:
                continue


def _add_histograms(into: dict[Any, dict[int, float]], other: Mapping[Any, Mapping[int, float]]) -> None:
    for key, hist in other.items():
        mine = into[key]
        for b, w in hist.items():
            mine[b] += w


def _add_dataclass(into: KCounts | PositionCounts, other: KCounts | PositionCounts) -> None:
    for f in fields(other):
        setattr(into, f.name, getattr(into, f.name) + getattr(other, f.name))


def _number(value: object) -> float:
    """A stored counter as a usable number: anything negative, infinite or not a number counts as 0."""
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0
    return x if x >= 0 and x != float("inf") else 0.0  # NaN fails the comparison


def decay_weight(age_seconds: float, half_life_seconds: float) -> float:
    return 0.5 ** (max(age_seconds, 0.0) / half_life_seconds)


@dataclass(frozen=True)
class Aggregate:
    """Rounds of one request (or interval) with one drafter and one K: a validated RoundsAggregate."""

    segment: str
    drafter: str
    k: int  # the K the rounds ran with
    rounds: int
    num_drafted: int
    accepted: int
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
    calibration: bool = False  # measured by the worker before serving: costs only, in no segment

    def realised_speedup(self, step_seconds: float) -> float:
        """Tokens emitted per plain step's worth of this aggregate's time (drafting and verification): its speedup
        over plain decoding at ``step_seconds`` a step; 0 when not measurable."""
        seconds = self.draft_seconds + self.verify_seconds
        if self.counterfactual or not self.tokens_emitted or not (seconds > 0 and step_seconds > 0):
            return 0.0
        value = self.tokens_emitted * step_seconds / seconds
        return value if math.isfinite(value) else 0.0

    def calibration_fields(self, step_seconds: float) -> dict[str, float]:
        """The segment-hash increment recording realised / expected speedup (one observation of a histogram, read
        as its median: one stalled request is one rank), when both are known."""
        if self.drafter == "none" or not self.expected_speedup > 0:
            return {}
        b = bin_of(self.realised_speedup(step_seconds) / self.expected_speedup)
        return {} if b is None else {f"{CALIBRATION}|{self.drafter}|{b}": 1.0}

    def segment_fields(self) -> dict[str, float]:
        """Increments for the segment's bucket hash."""
        d, k = self.drafter, self.k
        fields: dict[str, float] = {}
        if self.calibration:
            return fields
        if not self.counterfactual:
            fields |= {
                f"k|{d}|{k}|rounds": self.rounds,
                f"k|{d}|{k}|proposed": self.num_drafted,
                f"k|{d}|{k}|accepted": self.accepted,
                f"k|{d}|{k}|tokens": self.tokens_emitted,
                f"k|{d}|{k}|draft_s": self.draft_seconds,
                f"k|{d}|{k}|verify_s": self.verify_seconds,
            }
        plain = self.by_drafted[0] if self.by_drafted and not self.counterfactual else (0, 0.0)
        step_bin = bin_of(plain[1] / plain[0]) if plain[0] else None
        if step_bin is not None:
            fields[f"{PLAIN_STEP}|{batch_bucket(self.batch_size)}|{step_bin}"] = 1.0
        kind = COUNTERFACTUAL if self.counterfactual else SERVED
        for i in range(k):
            fields[f"{kind}|{d}|{i}|offered"] = self.rounds
            fields[f"{kind}|{d}|{i}|proposed"] = _at(self.proposed_per_position, i)
            fields[f"{kind}|{d}|{i}|verified"] = _at(self.verified_per_position, i)
            fields[f"{kind}|{d}|{i}|accepted"] = _at(self.accepted_per_position, i)
        return {name: float(v) for name, v in fields.items()}

    def cost_fields(self) -> dict[str, float]:
        """Increments for the global cost hash: drafting time per drafted token and verification time per n, both
        in the batch bucket the rounds ran in."""
        if self.counterfactual or not self.rounds:
            return {}
        bucket = batch_bucket(self.batch_size)
        fields: dict[str, float] = {}
        if self.drafter != "none" and self.num_drafted:
            fields[f"e|{self.drafter}|{bucket}|s"] = self.draft_seconds
            fields[f"e|{self.drafter}|{bucket}|n"] = float(self.num_drafted)
            b = bin_of(self.draft_seconds / self.num_drafted)
            if b is not None:
                fields[f"{DRAFT_HIST}|{self.drafter}|{bucket}|{b}"] = 1.0  # one request, one observation
        for n, (rounds, seconds) in enumerate(self.by_drafted):
            if rounds:
                fields[f"w|{n}|{bucket}|s"] = seconds
                fields[f"w|{n}|{bucket}|r"] = float(rounds)
                b = bin_of(seconds / rounds)
                if b is not None:
                    fields[f"{VERIFY_HIST}|{n}|{bucket}|{b}"] = 1.0
        return fields


def _at(values: tuple[int, ...], i: int) -> int:
    return values[i] if i < len(values) else 0
