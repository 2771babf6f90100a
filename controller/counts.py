"""What the controller learns, as plain counts: per segment × drafter × K × draft position.

Counts live in Redis as hash fields (see store.py for the key schema). These classes parse those fields,
add them up with decay weights, and derive rates. Everything here is pure.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

# Field names inside a segment bucket hash (K-level and position-level counters).
K_FIELDS = ("rounds", "proposed", "accepted", "tokens", "draft_s", "verify_s")
POSITION_FIELDS = ("offered", "proposed", "verified", "accepted")


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


@dataclass
class SegmentCounts:
    by_k: dict[tuple[str, int], KCounts] = field(default_factory=lambda: defaultdict(KCounts))
    positions: dict[tuple[str, int], PositionCounts] = field(default_factory=lambda: defaultdict(PositionCounts))
    last_update: float = 0.0

    @property
    def rounds(self) -> float:
        return sum(c.rounds for c in self.by_k.values())

    def drafters(self) -> list[str]:
        return sorted({d for d, _ in self.by_k} | {d for d, _ in self.positions})

    def position_list(self, drafter: str) -> list[PositionCounts]:
        """Positions 0.. of ``drafter`` in order (missing positions are zero counts)."""
        known = [i for d, i in self.positions if d == drafter]
        return [self.positions.get((drafter, i), PositionCounts()) for i in range(max(known, default=-1) + 1)]

    def add(self, other: SegmentCounts) -> None:
        for key, k in other.by_k.items():
            _add_dataclass(self.by_k[key], k)
        for key, p in other.positions.items():
            _add_dataclass(self.positions[key], p)
        self.last_update = max(self.last_update, other.last_update)

    def add_fields(self, values: Mapping[str, float], weight: float = 1.0) -> None:
        """Add a bucket's hash fields, scaled by ``weight`` (the decay of the bucket's age)."""
        for name, value in values.items():
            parts = name.split("|")
            if parts[0] == "k" and len(parts) == 4 and parts[3] in K_FIELDS:
                target: KCounts | PositionCounts = self.by_k[(parts[1], int(parts[2]))]
            elif parts[0] == "p" and len(parts) == 4 and parts[3] in POSITION_FIELDS:
                target = self.positions[(parts[1], int(parts[2]))]
            elif name == "updated":
                self.last_update = max(self.last_update, float(value))
                continue
            else:
                continue  # a field of a newer schema: ignore rather than fail
            setattr(target, parts[3], getattr(target, parts[3]) + weight * float(value))


@dataclass
class CostCounts:
    """Measured costs, over all segments: drafting time per drafter, verification time per length."""

    draft_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    drafted: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    # (tokens verified beyond the head token, batch bucket) -> seconds, rounds
    verify_s: dict[tuple[int, int], float] = field(default_factory=lambda: defaultdict(float))
    verify_rounds: dict[tuple[int, int], float] = field(default_factory=lambda: defaultdict(float))

    def add(self, other: CostCounts) -> None:
        for mine, theirs in (
            (self.draft_s, other.draft_s),
            (self.drafted, other.drafted),
            (self.verify_s, other.verify_s),
            (self.verify_rounds, other.verify_rounds),
        ):
            for key, value in theirs.items():
                mine[key] += value  # type: ignore[index]

    def add_fields(self, values: Mapping[str, float], weight: float = 1.0) -> None:
        for name, value in values.items():
            parts = name.split("|")
            v = weight * float(value)
            if parts[0] == "d" and len(parts) == 3:
                (self.draft_s if parts[2] == "s" else self.drafted)[parts[1]] += v
            elif parts[0] == "v" and len(parts) == 4:
                key = (int(parts[1]), int(parts[2]))
                (self.verify_s if parts[3] == "s" else self.verify_rounds)[key] += v


def _add_dataclass(into: KCounts | PositionCounts, other: KCounts | PositionCounts) -> None:
    for f in fields(other):
        setattr(into, f.name, getattr(into, f.name) + getattr(other, f.name))


def batch_bucket(batch_size: int) -> int:
    """Batch sizes are grouped in powers of two (1, 2, 4, 8, 16, …) for cost statistics."""
    bucket = 1
    while bucket < batch_size:
        bucket *= 2
    return bucket


def decay_weight(age_seconds: float, half_life_seconds: float) -> float:
    return 0.5 ** (max(age_seconds, 0.0) / half_life_seconds)


@dataclass(frozen=True)
class Aggregate:
    """Rounds of one request (or interval) with one drafter and one K: a validated ReportRounds entry."""

    segment: str
    drafter: str
    num_draft_tokens: int  # K asked for
    rounds: int
    proposed: int
    accepted: int
    proposed_per_position: tuple[int, ...]
    verified_per_position: tuple[int, ...]
    accepted_per_position: tuple[int, ...]
    tokens_emitted: int
    draft_seconds: float
    verify_seconds: float
    batch_size: int
    temperature: float = 0.0
    prompt_tokens: int = 0
    self_repetition: float = 0.0

    def segment_fields(self) -> dict[str, float]:
        """Increments for the segment's bucket hash."""
        d, k = self.drafter, self.num_draft_tokens
        fields = {
            f"k|{d}|{k}|rounds": self.rounds,
            f"k|{d}|{k}|proposed": self.proposed,
            f"k|{d}|{k}|accepted": self.accepted,
            f"k|{d}|{k}|tokens": self.tokens_emitted,
            f"k|{d}|{k}|draft_s": self.draft_seconds,
            f"k|{d}|{k}|verify_s": self.verify_seconds,
        }
        for i in range(k):
            fields[f"p|{d}|{i}|offered"] = self.rounds
            fields[f"p|{d}|{i}|proposed"] = _at(self.proposed_per_position, i)
            fields[f"p|{d}|{i}|verified"] = _at(self.verified_per_position, i)
            fields[f"p|{d}|{i}|accepted"] = _at(self.accepted_per_position, i)
        return {name: float(v) for name, v in fields.items()}

    def cost_fields(self) -> dict[str, float]:
        """Increments for the global cost hash: drafting time per token, verify time per length."""
        fields: dict[str, float] = {}
        if self.proposed and self.drafter != "none":
            fields[f"d|{self.drafter}|s"] = self.draft_seconds
            fields[f"d|{self.drafter}|n"] = float(self.proposed)
        if self.rounds:
            length = round(self.proposed / self.rounds)  # mean tokens verified besides the head token
            bucket = batch_bucket(self.batch_size)
            fields[f"v|{length}|{bucket}|s"] = self.verify_seconds
            fields[f"v|{length}|{bucket}|r"] = float(self.rounds)
        return fields


def _at(values: tuple[int, ...], i: int) -> int:
    return values[i] if i < len(values) else 0
