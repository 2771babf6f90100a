"""Telemetry in Redis: the key schema, atomic ingestion, and decayed reads.

Key schema (``P`` is the configurable prefix, default ``specd``; the schema version is part of every key):

    P:v1:seg:{segment}:{bucket}   hash   counters of one segment in one time bucket (see counts.py fields:
                                         k|{drafter}|{K}|{rounds,proposed,accepted,tokens,draft_s,verify_s},
                                         p|{drafter}|{position}|{offered,proposed,verified,accepted} (served),
                                         q|{drafter}|{position}|{...the same} (counterfactual), updated)
    P:v1:cost:{bucket}            hash   e|{drafter}|{batch bucket}|{s,n} drafting seconds / tokens drafted,
                                         w|{n}|{batch bucket}|{s,r} verify seconds / rounds that verified
                                         exactly n drafts (fields of an earlier schema, d|... and v|..., which
                                         mixed round lengths, are ignored)
    P:v1:segments                 zset   segment -> last report time (the cap on distinct active segments;
                                         segments silent for a whole window are dropped from it)
    P:v1:report:{report_id}       string dedup marker of an acknowledged report (expires)
    P:v1:samples                  list   recent per-aggregate feature rows for the prior model (capped)
    P:v1:prior                    string the prior model's coefficients as JSON (never pickle)

``bucket`` = floor(unix time / bucket_seconds). Buckets expire after the learning window; reads weight
each bucket by 0.5^(age / half_life), so recent traffic dominates and α follows drift within minutes.
Every report is applied by one Lua script: the dedup check, the segment cap and all increments happen
atomically, so concurrent reporters and controller replicas never lose or double an increment.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis

from controller.counts import Aggregate, CostCounts, SegmentCounts, decay_weight
from specd_api.segments import OVERFLOW_SEGMENT

INGEST_LUA = """
-- KEYS[1] report dedup key, KEYS[2] segments zset, KEYS[3] cost bucket hash, KEYS[4] samples list
-- ARGV: seg key prefix, bucket, bucket ttl, report ttl, now, max segments, overflow segment,
--       samples max, the report payload as JSON, the oldest report time still in the window
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[4]) == false then
  return {1, 0}
end
-- the cap counts active segments: those silent for a whole window give their place back
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[10])
local report = cjson.decode(ARGV[9])
local max_segments = tonumber(ARGV[6])
local stored = 0
for _, agg in ipairs(report.aggregates) do
  local segment = agg.segment
  if redis.call('ZSCORE', KEYS[2], segment) == false and redis.call('ZCARD', KEYS[2]) >= max_segments then
    segment = ARGV[7]
  end
  redis.call('ZADD', KEYS[2], ARGV[5], segment)
  local key = ARGV[1] .. segment .. ':' .. ARGV[2]
  for name, value in pairs(agg.fields) do
    redis.call('HINCRBYFLOAT', key, name, value)
  end
  redis.call('HSET', key, 'updated', ARGV[5])
  redis.call('EXPIRE', key, ARGV[3])
  stored = stored + agg.rounds
end
for name, value in pairs(report.cost) do
  redis.call('HINCRBYFLOAT', KEYS[3], name, value)
end
redis.call('EXPIRE', KEYS[3], ARGV[3])
for _, row in ipairs(report.samples) do
  redis.call('LPUSH', KEYS[4], row)
end
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[8]) - 1)
return {0, stored}
"""


@dataclass(frozen=True)
class StoreConfig:
    prefix: str = "specd"
    bucket_seconds: float = 60.0
    half_life_seconds: float = 600.0
    window_buckets: int = 60
    max_segments: int = 1000
    report_ttl_seconds: int = 3600
    samples_max: int = 20_000

    @property
    def bucket_ttl_seconds(self) -> int:
        return math.ceil(self.bucket_seconds * (self.window_buckets + 1))


@dataclass(frozen=True)
class IngestResult:
    rounds: int
    duplicate: bool


@dataclass
class Snapshot:
    """Decayed counts of the active segments and the costs, as of one refresh, and for drift detection the raw
    (undecayed) first-position counts per time bucket: series[segment][drafter] = [(bucket, accepted, verified)]
    in time order, served and counterfactual rounds together."""

    segments: dict[str, SegmentCounts] = field(default_factory=dict)
    costs: CostCounts = field(default_factory=CostCounts)
    taken_at: float = 0.0
    series: dict[str, dict[str, list[tuple[int, float, float]]]] = field(default_factory=dict)


class TelemetryStore:
    """Reads and writes the key schema above; all methods may raise redis.RedisError."""

    def __init__(self, client: redis.Redis, config: StoreConfig, clock: Callable[[], float]) -> None:
        self.client = client
        self.config = config
        self.clock = clock
        self._ingest = client.register_script(INGEST_LUA)
        self._closed: dict[str, dict[str, float]] = {}  # cache of buckets that no longer receive writes
        self._closed_read_at: dict[str, float] = {}

    def key(self, *parts: str | int) -> str:
        return ":".join((self.config.prefix, "v1", *map(str, parts)))

    def bucket(self, now: float) -> int:
        return int(now // self.config.bucket_seconds)

    # --- writes -------------------------------------------------------------------------------------

    def ingest(self, report_id: str, aggregates: Sequence[Aggregate]) -> IngestResult:
        """Apply one report atomically; a report_id seen before (within the TTL) changes nothing."""
        now = self.clock()
        cost: dict[str, float] = {}
        for agg in aggregates:
            for name, value in agg.cost_fields().items():
                cost[name] = cost.get(name, 0.0) + value
        payload = {
            "aggregates": [
                {"segment": a.segment, "rounds": a.rounds, "fields": _nonzero(a.segment_fields())} for a in aggregates
            ],
            "cost": _nonzero(cost),
            "samples": [json.dumps(_sample_row(a, now)) for a in aggregates if a.drafter != "none" and a.rounds],
        }
        c = self.config
        stored = self._ingest(
            keys=[
                self.key("report", report_id),
                self.key("segments"),
                self.key("cost", self.bucket(now)),
                self.key("samples"),
            ],
            args=[
                self.key("seg") + ":",
                self.bucket(now),
                c.bucket_ttl_seconds,
                c.report_ttl_seconds,
                now,
                c.max_segments,
                OVERFLOW_SEGMENT,
                c.samples_max,
                json.dumps(payload),
                now - c.bucket_seconds * c.window_buckets,
            ],
        )
        duplicate, rounds = stored  # {1, 0} for a report id seen before, else {0, rounds stored}
        return IngestResult(rounds=int(rounds), duplicate=bool(int(duplicate)))

    def save_prior(self, document: dict[str, Any]) -> None:
        self.client.set(self.key("prior"), json.dumps(document))

    # --- reads --------------------------------------------------------------------------------------

    def active_segments(self) -> list[str]:
        since = self.clock() - self.config.bucket_seconds * self.config.window_buckets
        return [str(s) for s in self.client.zrangebyscore(self.key("segments"), since, "+inf")]

    def read_snapshot(self, segments: Sequence[str], since: Mapping[str, int] | None = None) -> Snapshot:
        """Decayed counts of ``segments`` and of the costs, reading each closed bucket rarely. A segment named in
        ``since`` counts only its buckets from that one on (its acceptance drifted there: the older traffic no
        longer describes it)."""
        now = self.clock()
        current = self.bucket(now)
        buckets = range(current - self.config.window_buckets + 1, current + 1)
        keys = [self.key("seg", s, b) for s in segments for b in buckets] + [self.key("cost", b) for b in buckets]
        fields = self._read_buckets(keys, current_suffix=f":{current}", now=now)
        snapshot = Snapshot(taken_at=now)
        weights = {
            b: decay_weight(now - (b + 1) * self.config.bucket_seconds, self.config.half_life_seconds) for b in buckets
        }
        since = since or {}
        for s in segments:
            counts = SegmentCounts()
            series: dict[str, list[tuple[int, float, float]]] = {}
            for b in buckets:
                bucket_fields = fields[self.key("seg", s, b)]
                if b >= since.get(s, b):
                    counts.add_fields(bucket_fields, weights[b])
                for drafter, accepted, verified in first_position(bucket_fields):
                    series.setdefault(drafter, []).append((b, accepted, verified))
            snapshot.segments[s] = counts
            snapshot.series[s] = series
        for b in buckets:
            snapshot.costs.add_fields(fields[self.key("cost", b)], weights[b])
        return snapshot

    def read_samples(self, limit: int) -> list[dict[str, float]]:
        return [json.loads(row) for row in self.client.lrange(self.key("samples"), 0, limit - 1)]

    def read_prior(self) -> dict[str, Any] | None:
        raw = self.client.get(self.key("prior"))
        return json.loads(raw) if raw else None

    def _read_buckets(self, keys: list[str], current_suffix: str, now: float) -> dict[str, dict[str, float]]:
        """HGETALL every key, but closed buckets only once a bucket period (other replicas' late writes)."""
        stale_after = self.config.bucket_seconds
        to_read = [
            k
            for k in keys
            if k.endswith(current_suffix) or k not in self._closed or now - self._closed_read_at[k] > stale_after
        ]
        pipe = self.client.pipeline(transaction=False)
        for k in to_read:
            pipe.hgetall(k)
        result: dict[str, dict[str, float]] = {}
        for k, raw in zip(to_read, pipe.execute(), strict=True):
            parsed = _numbers(raw)
            result[k] = parsed
            if not k.endswith(current_suffix):
                self._closed[k], self._closed_read_at[k] = parsed, now
        keep = set(keys)
        for k in list(self._closed):
            if k not in keep:  # fell out of the window
                del self._closed[k], self._closed_read_at[k]
        return {k: result[k] if k in result else self._closed[k] for k in keys}


def _numbers(raw: Mapping[object, object]) -> dict[str, float]:
    """A hash's fields as numbers; a field that is not one (hand-edited or corrupt data) is left out."""
    parsed = {}
    for name, value in raw.items():
        try:
            parsed[str(name)] = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
    return parsed


def first_position(fields: Mapping[str, float]) -> list[tuple[str, float, float]]:
    """(drafter, accepted, verified) at draft position 0 in one bucket hash, served and counterfactual together."""
    totals: dict[str, list[float]] = {}
    for name, value in fields.items():
        parts = name.split("|")
        if len(parts) == 4 and parts[0] in ("p", "q") and parts[2] == "0" and parts[3] in ("accepted", "verified"):
            entry = totals.setdefault(parts[1], [0.0, 0.0])
            entry[0 if parts[3] == "accepted" else 1] += value if math.isfinite(value) and value > 0 else 0.0
    return [(d, a, v) for d, (a, v) in sorted(totals.items()) if v > 0]


def _nonzero(fields: dict[str, float]) -> dict[str, float]:
    return {name: value for name, value in fields.items() if value}


def _sample_row(agg: Aggregate, now: float) -> dict[str, float | str]:
    """One training row for the prior: request features and the per-token acceptance outcome."""
    verified = sum(agg.verified_per_position)
    accepted = sum(agg.accepted_per_position)
    return {
        "drafter": agg.drafter,
        "temperature": agg.temperature,
        "prompt_tokens": agg.prompt_tokens,
        "self_repetition": agg.self_repetition,
        "verified": verified,
        "accepted": accepted,
        "at": now,
    }
