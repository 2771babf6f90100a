"""Telemetry in Redis: atomic ingestion and decayed reads (the I/O and the Lua scripts). Key and field names, and
the stored rows, are redis_schema.py's.

Buckets expire after the learning window; reads weight each bucket by 0.5^(age / half_life), so recent traffic
dominates and α follows drift within minutes.

A report is applied in parts, each by one Lua script, atomically, with its own dedup marker:
1. the global part (``HEAD_LUA``, slot of ``{#global}``): the segment cap decides, for each segment of the report,
   the segment it is counted as (itself or the overflow segment), and the cost and sample rows are added;
2. one part per segment counted (``SEGMENT_LUA``, slot of ``{S}``): that segment's increments.
A retry (same report_id) re-runs every part; each part that was applied before changes nothing, so a report cut
short between parts (a lost connection, a failed node) is completed by its retry and every part counts exactly once.
Concurrent reporters and controller replicas never lose or double an increment. The cap is decided in one script
on one slot, so it is exact: two new segments racing for the last place are serialized there. What is not
atomic is the report as a whole: between parts, a reader may see a segment admitted whose counts have not landed.

3. the change marks (``MARK_LUA``, slot of ``{#global}``), after the segment parts: each segment counted gets the
   next number of a counter Redis keeps, so that a refresh asks which segments changed since its last read by that
   number, not by anyone's clock (``read_changes``), and keeps every other segment's counts without reading them.
   A mark comes after its parts, so a mark a refresh has not seen yet is for a write it may not have read.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, cast

import redis
from redis.cluster import RedisCluster
from redis.exceptions import NoScriptError

from controller.decision.counts import Aggregate, CostCounts, SegmentCounts, clean_bucket, decay_weight
from controller.pacing import Pacer, no_pause
from controller.storage.redis_schema import Keys, encode_sample, first_position, sample_row, stored_json
from controller.storage.report_increments import cost_increments, segment_increments
from specd_api.modes import valid_learning_segment
from specd_api.segments import OVERFLOW_SEGMENT

log = logging.getLogger(__name__)

RedisClient = redis.Redis | RedisCluster  # one server, or a cluster (``redis+cluster://``; redis_conn.py)
# Bucket hashes a refresh asks for in one round trip. The replies are parsed in Python with the interpreter held: in
# one pipeline, the 2,000 keys of 1,000 segments reported in the last minute would hold it ~100 ms at every refresh,
# and every Decide waits for the interpreter. Between chunks the refresh is paced.
READ_CHUNK_KEYS = 32

# What every write script starts with: stored data a writer cannot use never stops the writes (without it, one cost
# bucket, samples list or segments set of another type, set by hand or by another program, fails every report with
# WRONGTYPE: all of them journaled, the controller stale, until the key goes; and a segment's field holding no
# number fails HINCRBYFLOAT after the part's dedup marker is set, so the part is lost and its retry a duplicate).
# A key of another type than its name says holds nothing a reader can use (the reads skip it): it is deleted before
# the script writes there. A field whose value is not a number, or whose sum would not be finite, is set to the
# increment. The script's reply names each ('key' or 'key field'): the writer counts and logs them.
REPAIR_LUA = """
local repaired = {}
local function claim(key, kind)
  local found = redis.call('TYPE', key).ok
  if found ~= 'none' and found ~= kind then
    redis.call('UNLINK', key)  -- freed in the background: a huge key of another type does not block Redis
    table.insert(repaired, key)
  end
end
local function add(key, field, increment)
  local sum = redis.pcall('HINCRBYFLOAT', key, field, increment)
  if type(sum) == 'table' and sum.err then
    redis.call('HSET', key, field, increment)
    table.insert(repaired, key .. ' ' .. field)
  end
end
"""

HEAD_LUA = (
    REPAIR_LUA
    + """
-- KEYS[1] the report's global dedup marker, KEYS[2] segments zset, KEYS[3] cost bucket hash, KEYS[4] samples list
-- ARGV: report ttl, now, max segments, overflow segment, samples max, bucket ttl,
--       the oldest report time still in the window, the report's global part as JSON
-- Returns {1, verdict, repaired} for a report id seen before, else {0, verdict, repaired}; verdict:
-- 'segment=counted_as' for each of the report's segments, separated by spaces (segment names hold neither).
claim(KEYS[1], 'string')
claim(KEYS[2], 'zset')
claim(KEYS[3], 'hash')
claim(KEYS[4], 'list')
local seen = redis.call('GET', KEYS[1])
if seen then
  return {1, seen, repaired}
end
-- the cap counts active segments: those silent for a whole window give their place back
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. ARGV[7])
local report = cjson.decode(ARGV[8])
local max_segments = tonumber(ARGV[3])
local counted_as = {}
for i, segment in ipairs(report.segments) do
  if redis.call('ZSCORE', KEYS[2], segment) == false and redis.call('ZCARD', KEYS[2]) >= max_segments then
    segment = ARGV[4]
  end
  redis.call('ZADD', KEYS[2], ARGV[2], segment)
  counted_as[i] = report.segments[i] .. '=' .. segment
end
for name, value in pairs(report.cost) do
  add(KEYS[3], name, value)
end
redis.call('EXPIRE', KEYS[3], ARGV[6])
for _, row in ipairs(report.samples) do
  redis.call('LPUSH', KEYS[4], row)
end
redis.call('LTRIM', KEYS[4], 0, tonumber(ARGV[5]) - 1)
local verdict = table.concat(counted_as, ' ')
redis.call('SET', KEYS[1], verdict, 'EX', ARGV[1])
return {0, verdict, repaired}
"""
)

SEGMENT_LUA = (
    REPAIR_LUA
    + """
-- KEYS[1] the report's dedup marker for this segment, KEYS[2] the segment's hash in the current bucket
-- ARGV: report ttl, now, bucket ttl, then the report's increments to the hash: field, increment, field, ...
--       (each field once: report_increments.py sums the report's aggregates)
-- Returns {0, repaired} when this part of the report was applied before, else {1, repaired}.
claim(KEYS[1], 'string')
claim(KEYS[2], 'hash')
if redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[1]) == false then
  return {0, repaired}
end
for i = 4, #ARGV, 2 do
  add(KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('HSET', KEYS[2], 'updated', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return {1, repaired}
"""
)

MARK_LUA = (
    REPAIR_LUA
    + """
-- KEYS[1] the change marks (zset: segment -> the mark's number), KEYS[2] their state (hash: epoch, seq, trimmed)
-- ARGV: the most marks kept, an epoch for a new state, then the segments a report changed (their parts applied)
-- Returns {the mark's number, repaired}.
claim(KEYS[1], 'zset')
claim(KEYS[2], 'hash')
redis.call('HSETNX', KEYS[2], 'epoch', ARGV[2])
local seq = redis.pcall('HINCRBY', KEYS[2], 'seq', 1)
if type(seq) == 'table' and seq.err then
  -- a seq that is no integer: the state starts again under a new epoch (not this writer's usual one, which is
  -- likely the one stored: a reader that saw seq N would then skip the marks 1..N), which tells readers the marks
  -- were lost
  local now = redis.call('TIME')
  redis.call('UNLINK', KEYS[1], KEYS[2])
  redis.call('HSET', KEYS[2], 'epoch', ARGV[2] .. ':' .. now[1] .. '.' .. now[2])
  seq = redis.call('HINCRBY', KEYS[2], 'seq', 1)
  table.insert(repaired, KEYS[2] .. ' seq')
end
for i = 3, #ARGV do
  redis.call('ZADD', KEYS[1], seq, ARGV[i])
end
local excess = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[1])
if excess > 0 then
  -- the oldest marks go; a reader that had not seen the newest of them reads everything (``trimmed``)
  local gone = redis.call('ZRANGE', KEYS[1], excess - 1, excess - 1, 'WITHSCORES')
  if tonumber(gone[2]) > (tonumber(redis.call('HGET', KEYS[2], 'trimmed')) or 0) then
    redis.call('HSET', KEYS[2], 'trimmed', gone[2])
  end
  redis.call('ZREMRANGEBYRANK', KEYS[1], 0, excess - 1)
end
return {seq, repaired}
"""
)

CHANGES_LUA = """
-- KEYS[1] the change marks, KEYS[2] their state, KEYS[3] the segments zset; ARGV[1] the last mark the reader saw
-- ('+inf': none), ARGV[2] the oldest report time in the window
-- Returns {epoch, seq, trimmed, the segments marked after ARGV[1], how many segments are in the window}, read
-- together (the count: a segments zset changed by other means than a report, or of the wrong type, is read again).
local state = redis.call('HMGET', KEYS[2], 'epoch', 'seq', 'trimmed')
local marked = redis.call('ZRANGEBYSCORE', KEYS[1], '(' .. ARGV[1], '+inf')
local active = redis.call('ZCOUNT', KEYS[3], ARGV[2], '+inf')
return {state[1] or '', state[2] or '0', state[3] or '0', marked, active}
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
    # Decay is read at the start of this step (0: at each read). With a step, a count that no report touches keeps
    # its weight for the step, so a refresh that finds no new report finds every count as it was.
    decay_step_seconds: float = 0.0

    @property
    def bucket_ttl_seconds(self) -> int:
        return math.ceil(self.bucket_seconds * (self.window_buckets + 1))

    @property
    def late_write_seconds(self) -> float:
        """How long before a refresh (by its clock) a write it did not see may be dated: another replica's clock
        skew, a report's segment parts landing after its head. One bucket period."""
        return self.bucket_seconds


@dataclass(frozen=True)
class Marks:
    """Where a read of the change marks ended: the marks' epoch and the last mark's number."""

    epoch: str
    seq: int


@dataclass(frozen=True)
class IngestResult:
    rounds: int
    duplicate: bool


@dataclass(frozen=True, slots=True)
class BucketFields:
    """What a segment's (or the costs') counts are made of: the window's non-empty buckets, in time order, with their
    hashes' fields.

    Held as two tuples, the buckets' numbers and their fields, not as a (bucket, fields) pair a bucket. CPython's cyclic
    collector stops tracking a tuple of atomic values at its first pass over it, but never one that holds a dict. As
    pairs, 1,000 segments x 60 buckets kept 60,000 tracked tuples, all walked by every full collection: about 100 ms of
    the interpreter each on the shared cores, two or three times a decay step. As two tuples it is three objects a
    segment, and the numbers' tuple is untracked at the first pass."""

    buckets: tuple[int, ...] = ()  # increasing
    fields: tuple[dict[str, float], ...] = ()  # fields[i] is buckets[i]'s hash, none empty

    @classmethod
    def read(
        cls, buckets: range, fields_of: Callable[[int], dict[str, float]],
        clean: Callable[[dict[str, float]], dict[str, float]],
    ) -> BucketFields:  # fmt: skip
        """The non-empty buckets of ``buckets`` (``fields_of`` each), each ``clean``ed."""
        numbers, kept = [], []
        for b in buckets:
            found = fields_of(b)
            if found:
                numbers.append(b)
                kept.append(clean(found))
        return cls(tuple(numbers), tuple(kept))

    def __iter__(self) -> Iterator[tuple[int, dict[str, float]]]:
        return zip(self.buckets, self.fields, strict=True)

    def __len__(self) -> int:
        return len(self.buckets)

    def __add__(self, later: BucketFields) -> BucketFields:
        """These buckets, then ``later``'s (all of them after these)."""
        return BucketFields(self.buckets + later.buckets, self.fields + later.fields)

    def between(self, first: int, end: int) -> BucketFields:
        """The buckets from ``first`` up to ``end`` (not included): the same fields objects, not copies."""
        lo, hi = bisect.bisect_left(self.buckets, first), bisect.bisect_left(self.buckets, end)
        return BucketFields(self.buckets[lo:hi], self.fields[lo:hi])

    def ends_with(self, last: BucketFields) -> bool:
        """Are ``last``'s buckets and fields these' last ones?"""
        n = len(last.buckets)
        return (
            n <= len(self.buckets)
            and self.buckets[len(self.buckets) - n :] == last.buckets
            and (self.fields[len(self.fields) - n :] == last.fields)
        )


@dataclass
class Snapshot:
    """Decayed counts of the active segments and the costs, as of one refresh, and for drift detection the raw
    (undecayed) first-position counts per time bucket: series[segment][drafter] = [(bucket, accepted, verified)]
    in time order, served and counterfactual rounds together."""

    segments: dict[str, SegmentCounts] = field(default_factory=dict)
    costs: CostCounts = field(default_factory=CostCounts)
    taken_at: float = 0.0
    series: dict[str, dict[str, list[tuple[int, float, float]]]] = field(default_factory=dict)
    # what each segment's counts were made of: (the decay time, its regime's start, its window's non-empty buckets'
    # fields, ``BucketFields``). A segment whose sources are those of the previous
    # snapshot keeps its counts object (read_snapshot's ``previous``); the fields are what the next read starts from.
    sources: dict[str, tuple[float, int | None, BucketFields]] = field(default_factory=dict)
    cost_sources: tuple[float, BucketFields] | None = None  # the same for the costs
    current_bucket: int | None = None  # the bucket at ``taken_at`` (None: nothing read yet)
    marks: Marks | None = None  # the change marks read before it (``TelemetryStore.read_changes``)
    decay_at: float | None = None  # the decay step its counts are decayed to (None: nothing read yet)


class TelemetryStore:
    """Reads and writes the keys of redis_schema.py; all methods may raise redis.RedisError."""

    def __init__(self, client: RedisClient, config: StoreConfig, clock: Callable[[], float]) -> None:
        self.client = client
        self.config = config
        self.clock = clock
        self.keys = Keys(config.prefix)
        self._head = client.register_script(HEAD_LUA)
        self._segment = client.register_script(SEGMENT_LUA)
        self._mark = client.register_script(MARK_LUA)
        self._changes = client.register_script(CHANGES_LUA)
        self._epoch = os.urandom(8).hex()  # the marks' epoch this store writes where none is (a new or flushed Redis)
        self.skipped = SkippedEntries()  # stored entries no read could use (counted, each key logged once)
        # each active segment's last report time (the segments sorted set's scores) and when they were read
        self._reported: dict[str, float] = {}
        self._reported_read_at = -math.inf
        self._scores: list[float] = []  # every member's score in that read (names no read uses too)
        # the change marks: where the read before the last one ended, where the last one ended, and the segments
        # marked in between (None: not known, any may have changed)
        self._marks_from: Marks | None = None
        self._marks_to: Marks | None = None
        self._changed: frozenset[str] | None = None

    def bucket(self, now: float) -> int:
        return int(now // self.config.bucket_seconds)

    # --- writes -------------------------------------------------------------------------------------

    def ingest(
        self, report_id: str, aggregates: Sequence[Aggregate], step_seconds: Callable[[str, int], float] | None = None
    ) -> IngestResult:
        """Apply one report, each part atomically (module docstring); a report_id seen before (within the TTL)
        changes nothing, but completes the parts an earlier delivery did not get to. With ``step_seconds`` (a plain
        step's seconds in a segment at a batch size, 0 when not known), each aggregate's realised / expected speedup
        is recorded too (``cal|`` fields)."""
        now = self.clock()
        c = self.config
        pace = Pacer()  # a report sums up to MAX_AGGREGATES: other requests get the interpreter between chunks
        segments = list(dict.fromkeys(a.segment for a in aggregates if not a.start_up_timings))  # in order, each once
        duplicate, verdict = self._ingest_head(report_id, aggregates, segments, now, pace)
        counted_as = dict(pair.split("=", 1) for pair in verdict.split() if "=" in pair)
        parts: dict[str, dict[str, float]] = {}  # segment counted as -> its increments (segments over the cap: one)
        for segment, fields in segment_increments(aggregates, step_seconds, pace).items():
            if segment in counted_as:  # else a report id reused for other segments: not part of that report
                part = parts.setdefault(counted_as[segment], {})
                for name, value in fields.items():
                    part[name] = part.get(name, 0.0) + value
        calls = [
            (
                [self.keys.report(report_id, segment), self.keys.segment_bucket(segment, self.bucket(now))],
                [c.report_ttl_seconds, now, c.bucket_ttl_seconds, *chain.from_iterable(fields.items())],
            )
            for segment, fields in parts.items()
        ]
        self._ingest_segments(calls)
        self._mark_changed(list(parts))  # after the parts: a refresh that saw the mark reads what it marks
        return IngestResult(rounds=0 if duplicate else sum(a.rounds for a in aggregates), duplicate=duplicate)

    def _ingest_head(
        self, report_id: str, aggregates: Sequence[Aggregate], segments: list[str], now: float, pace: Pacer
    ) -> tuple[bool, str]:
        """Run the report's global part: (seen before, its verdict: 'segment=counted_as' for each of ``segments``,
        separated by spaces)."""
        payload = {
            "segments": segments,
            "cost": cost_increments(aggregates, pace),
            "samples": [
                encode_sample(
                    drafter=a.drafter,
                    temperature=a.temperature,
                    prompt_tokens=a.prompt_tokens,
                    self_repetition=a.self_repetition,
                    verified=sum(a.verified_per_position),
                    accepted=sum(a.accepted_per_position),
                    at=now,
                )
                for a in aggregates
                if a.drafter != "none" and a.rounds and not a.start_up_timings
            ],
        }
        c = self.config
        seen, verdict, repaired = self._head(
            keys=[
                self.keys.report(report_id),
                self.keys.segments(),
                self.keys.cost_bucket(self.bucket(now)),
                self.keys.samples(),
            ],
            args=[
                c.report_ttl_seconds,
                now,
                c.max_segments,
                OVERFLOW_SEGMENT,
                c.samples_max,
                c.bucket_ttl_seconds,
                now - c.bucket_seconds * c.window_buckets,
                json.dumps(payload),
            ],
        )
        self._repaired(repaired)
        return bool(int(seen)), verdict.decode() if isinstance(verdict, bytes) else str(verdict)

    def _repaired(self, names: Sequence[object]) -> None:
        """Count and log (once per key) what a write script replaced: a key of another type, or a field that held
        no number (``REPAIR_LUA``)."""
        for name in names:
            key = _text(name) or repr(name)
            self.skipped.add(key, "unusable stored data (another type, or not a number) replaced by a report's write")

    def _ingest_segments(self, calls: list[tuple[list[str], list[Any]]]) -> None:
        """Run the segment parts, (keys, args) each: on one server in one pipeline, on a cluster one call each (its
        pipelines refuse scripts). A server that has lost its script cache (a restart, a failover) answers NOSCRIPT:
        the script is loaded and every part sent again, which is safe because a part applied before changes
        nothing."""
        if isinstance(self.client, RedisCluster):
            for keys, args in calls:
                self._repaired(self._segment(keys=keys, args=args)[1])  # loads the script on NOSCRIPT
            return
        for attempt in range(2):
            pipe = self.client.pipeline(transaction=False)
            for keys, args in calls:
                pipe.evalsha(self._segment.sha, len(keys), *keys, *args)
            try:
                for _, repaired in pipe.execute():
                    self._repaired(repaired)
                return
            except NoScriptError:
                if attempt:
                    raise
                self.client.script_load(SEGMENT_LUA)

    def _mark_changed(self, segments: list[str]) -> None:
        """Mark ``segments`` changed (``MARK_LUA``), after their parts. Marks that cannot be written (a key of the
        wrong type at their names) are skipped and counted: the report is in, and readers that cannot read the
        marks either read every segment's recent buckets."""
        if not segments:
            return
        keep = 2 * (self.config.max_segments + 1)
        try:
            self._repaired(self._mark(keys=[self.keys.changes(), self.keys.change_state()],
                                      args=[keep, self._epoch, *segments])[1])  # fmt: skip
        except redis.ResponseError as e:
            self.skipped.add(self.keys.changes(), f"change marks not written ({e})")

    def save_prior(self, document: dict[str, Any]) -> None:
        self.client.set(self.keys.prior(), json.dumps(document))

    # --- reads --------------------------------------------------------------------------------------

    def read_changes(self, window_from: float) -> tuple[frozenset[str] | None, int | None]:
        """Read the change marks since the last read: (the segments a report changed in between, or None when that
        is not known: the first read, marks lost or trimmed past the last one seen, keys of the wrong type; how many
        segments have a report since ``window_from``, None when unreadable). The next ``read_snapshot`` keeps the
        counts of every other segment (``_plan_reads``)."""
        since = "+inf" if self._marks_to is None else str(self._marks_to.seq)
        keys = [self.keys.changes(), self.keys.change_state(), self.keys.segments()]
        changed: frozenset[str] | None = None
        now: Marks | None = None
        active: int | None = None
        try:
            epoch, seq, trimmed, marked, count = self._changes(keys=keys, args=[since, window_from])
            now, active = Marks(_text(epoch) or "", int(seq)), int(count)
            before = self._marks_to
            if before is not None and before.epoch == now.epoch and int(trimmed) <= before.seq <= now.seq:
                changed = frozenset(t for m in marked if (t := _text(m)) is not None)
        except (redis.ResponseError, ValueError) as e:  # WRONGTYPE, a value that is not a number: skipped, counted
            self.skipped.add(self.keys.change_state(), f"change marks unreadable ({e})")
        self._marks_from, self._marks_to, self._changed = self._marks_to, now, changed
        return changed, active

    def active_segments(self) -> list[str]:
        """The segments with a report in the window, after reading which changed since the last call
        (``read_changes``). Their last report times (the scores every replica's ingest writes) are read again only
        when the marks are not known, the bucket moved on, or the count in the window is not the list's (a new
        segment, one whose time here is older than its time there); else it is the list read before, less those now
        out of the window. A key of the wrong type there (hand-edited data) is skipped and counted: no segment is then
        tracked until reports rebuild it, but decisions go on."""
        now = self.clock()
        since = now - self.config.bucket_seconds * self.config.window_buckets
        changed, active = self.read_changes(since)
        if changed is not None and self._reported_read_at > -math.inf:
            in_window = sum(t >= since for t in self._scores)  # the members read, names no read uses too
            if active == in_window and self.bucket(now) == self.bucket(self._reported_read_at):
                self._reported = {s: t for s, t in self._reported.items() if t >= since}
                return list(self._reported)
        key = self.keys.segments()
        try:
            members = self.client.zrangebyscore(key, since, "+inf", withscores=True)
        except redis.ResponseError as e:  # WRONGTYPE: not a connection problem, nothing a retry would fix
            self.skipped.add(key, f"not a sorted set ({e})")
            self._reported, self._reported_read_at, self._scores = {}, now, []
            return []
        reported = {}
        self._scores = [float(score) for _, score in cast(list[tuple[bytes, float]], members)]
        for member, score in cast(list[tuple[bytes, float]], members):
            segment = _text(member)
            if segment is not None and valid_learning_segment(segment):
                reported[segment] = float(score)
        self._reported, self._reported_read_at = reported, now
        return list(reported)

    def read_snapshot(
        self, segments: Sequence[str], since: Mapping[str, int] | None = None, previous: Snapshot | None = None
    ) -> Snapshot:
        """Decayed counts of ``segments`` and of the costs (decayed to the start of the current decay step). A
        segment named in ``since`` counts only its buckets from that one on (its acceptance drifted there: the older
        traffic no longer describes it).

        With ``previous`` (the snapshot before), only what may have changed since is read (``_plan_reads``): a
        segment no change mark named since the marks read before ``previous`` (``read_changes``, called by
        ``active_segments``), in the same decay step and window, keeps ``previous``'s counts, the same object, with
        no key built and nothing read; any other reads only its buckets from one ``late_write_seconds`` before
        ``previous``, the older ones being ``previous``'s fields, and keeps ``previous``'s counts when the fields it
        is made of are the same. A write dated earlier than that margin (a replica whose clock is further off) is
        not seen: the margin is the bound on clock skew between replicas."""
        now = self.clock()
        current = self.bucket(now)
        first = current - self.config.window_buckets + 1
        step = self.config.decay_step_seconds
        decay_at = math.floor(now / step) * step if step > 0 else now
        since = since or {}
        snapshot = Snapshot(taken_at=now, current_bucket=current, marks=self._marks_to, decay_at=decay_at)
        fresh_from, kept, partial, whole = self._plan_reads(segments, since, previous, current, decay_at)
        keys = [self.keys.segment_bucket(s, b) for s in whole for b in range(first, current + 1)]
        keys += [self.keys.segment_bucket(s, b) for s in partial for b in range(fresh_from, current + 1)]
        keys += [self.keys.cost_bucket(b) for b in range(fresh_from, current + 1)]
        pace = Pacer()  # the refresh's reads and counts: Decide gets the interpreter every few milliseconds
        fields = self._read_buckets(keys, pace)
        weights = {
            b: decay_weight(decay_at - (b + 1) * self.config.bucket_seconds, self.config.half_life_seconds)
            for b in range(first, current + 1)
        }

        def read(
            key: Callable[[int], str], start: int, clean: Callable[[dict[str, float]], dict[str, float]]
        ) -> BucketFields:
            """The non-empty buckets read, from ``start`` to the current one, each ``clean``ed."""
            return BucketFields.read(range(start, current + 1), lambda b: fields[key(b)], clean)

        def kept_from(earlier: BucketFields) -> BucketFields:
            """``previous``'s buckets still in the window and not read again: the same fields, not copies."""
            return earlier.between(first, fresh_from)

        before = previous or Snapshot()
        for s in kept:
            snapshot.sources[s] = before.sources[s]
            snapshot.segments[s], snapshot.series[s] = before.segments[s], before.series[s]
        for s in whole:
            pace()
            made_of = read(functools.partial(self.keys.segment_bucket, s), first, clean_bucket)
            self._count(snapshot, s, (decay_at, since.get(s), made_of), weights, previous, first)
        for s in partial:
            pace()
            fresh = read(functools.partial(self.keys.segment_bucket, s), fresh_from, clean_bucket)
            made_of = kept_from(before.sources[s][2]) + fresh
            self._count(snapshot, s, (decay_at, since.get(s), made_of), weights, previous, fresh_from)
        costs_made_of = kept_from(before.cost_sources[1] if before.cost_sources else BucketFields())
        snapshot.cost_sources = (decay_at, costs_made_of + read(self.keys.cost_bucket, fresh_from, _as_read))
        if previous is not None and previous.cost_sources == snapshot.cost_sources:
            snapshot.costs = previous.costs
        else:
            for b, bucket_fields in snapshot.cost_sources[1]:
                snapshot.costs.add_fields(bucket_fields, weights[b])
        return snapshot

    def _plan_reads(
        self,
        segments: Sequence[str],
        since: Mapping[str, int],
        previous: Snapshot | None,
        current: int,
        decay_at: float,
    ) -> tuple[int, list[str], list[str], list[str]]:
        """What ``read_snapshot`` reads: (the first bucket read for a segment read in part and for the costs, the
        segments kept whole from ``previous``, those read from that bucket on, those read over the whole window)."""
        first = current - self.config.window_buckets + 1
        margin = self.config.late_write_seconds
        if previous is None or previous.current_bucket is None or previous.current_bucket > current:
            return first, [], [], list(segments)  # nothing to start from (or a clock that went back)
        fresh_from = max(first, self.bucket(min(previous.taken_at, self.clock()) - margin))
        same_window = previous.current_bucket == current
        # the segments a report may have changed since ``previous`` read them: those marked since the marks read
        # before it (None: any)
        changed = self._changed if previous.marks is not None and previous.marks == self._marks_from else None
        kept, partial, whole = [], [], []
        for s in segments:
            source = previous.sources.get(s)
            if source is None:
                whole.append(s)
            elif (
                same_window
                and source[0] == decay_at
                and source[1] == since.get(s)
                and changed is not None
                and s not in changed
            ):
                kept.append(s)
            else:
                partial.append(s)
        return fresh_from, kept, partial, whole

    def _count(
        self,
        snapshot: Snapshot,
        segment: str,
        source: tuple[float, int | None, BucketFields],
        weights: Mapping[int, float],
        previous: Snapshot | None,
        fresh_from: int,
    ) -> None:
        """The segment's counts and series from its buckets' fields (``source``), or ``previous``'s when they were
        made of the same. The series of the buckets before ``fresh_from`` (``previous``'s fields, kept) is
        ``previous``'s: a series is not decayed, so a decay step moves none of its entries."""
        snapshot.sources[segment] = source
        if previous is not None and previous.sources.get(segment) == source:
            snapshot.segments[segment], snapshot.series[segment] = previous.segments[segment], previous.series[segment]
            return
        _, regime, read = source
        counts = SegmentCounts()
        counts.add_buckets((f, weights[b]) for b, f in read if regime is None or b >= regime)  # in time order
        earlier = previous.series.get(segment, {}) if previous is not None else {}
        kept = {b for b, _ in read if b < fresh_from}  # buckets whose fields are previous's
        series: dict[str, list[tuple[int, float, float]]] = {}
        for drafter, entries in earlier.items():
            still = [e for e in entries if e[0] in kept]
            if still:  # the same object when none left: the drift test is not run again on an unmoved series
                series[drafter] = entries if len(still) == len(entries) else still
        for b, bucket_fields in read:
            if b >= fresh_from:
                for drafter, accepted, verified in first_position(bucket_fields):
                    entries = series.setdefault(drafter, [])
                    if entries is earlier.get(drafter):
                        entries = series[drafter] = list(entries)  # previous's list is previous's
                    entries.append((b, accepted, verified))
        snapshot.segments[segment] = counts
        snapshot.series[segment] = series

    def read_samples(self, limit: int) -> list[dict[str, Any]]:
        """The prior's training rows; a row that is not one (not JSON, a field missing or out of range) is skipped
        and counted, as is a key of the wrong type."""
        key = self.keys.samples()
        try:
            raw_rows = self.client.lrange(key, 0, limit - 1)
        except redis.ResponseError as e:
            self.skipped.add(key, f"not a list ({e})")
            return []
        rows = []
        for raw in raw_rows:
            row = sample_row(raw)
            if row is None:
                self.skipped.add(key, "a row that is not a training sample")
            else:
                rows.append(row)
        return rows

    def read_prior(self) -> dict[str, Any] | None:
        """The stored prior model's document, or None (none stored, or one that is not a JSON object: skipped and
        counted; the prior is refitted from the samples at its next due time)."""
        key = self.keys.prior()
        try:
            raw = self.client.get(key)
        except redis.ResponseError as e:
            self.skipped.add(key, f"not a string ({e})")
            return None
        if not raw:
            return None
        document = stored_json(raw)
        if not isinstance(document, dict):
            self.skipped.add(key, "not a JSON object")
            return None
        return document

    def _read_buckets(self, keys: list[str], pace: Callable[[], None] = no_pause) -> dict[str, dict[str, float]]:
        """HGETALL each key, in pipelines of READ_CHUNK_KEYS with ``pace()`` after each (as before, another client's
        writes may land between two keys' reads: the pipeline was never a transaction). A reply that is an error
        (WRONGTYPE: a key of another type at a bucket's name) spoils that key only; a connection error still raises
        (the learner then answers from memory, marked stale)."""
        result: dict[str, dict[str, float]] = {}
        for start in range(0, len(keys), READ_CHUNK_KEYS):
            chunk = keys[start : start + READ_CHUNK_KEYS]
            pipe = self.client.pipeline(transaction=False)
            for k in chunk:
                pipe.hgetall(k)
            for k, raw in zip(chunk, pipe.execute(raise_on_error=False), strict=True):
                if isinstance(raw, redis.ResponseError):
                    self.skipped.add(k, f"not a hash ({raw})")
                    raw = {}
                elif isinstance(raw, Exception):
                    raise raw
                result[k] = _numbers(raw)
            pace()  # between round trips: the interpreter to whoever waits for it
        return result


class SkippedEntries:
    """Stored entries a read had to skip (DESIGN contract 7: stored data never stops the controller): counted per
    key, each key logged once (a bad key is read at every refresh)."""

    MAX_LOGGED = 10_000  # keys remembered as logged (beyond, a bad key may be logged again: never unbounded memory)

    def __init__(self) -> None:
        self.count = 0
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def add(self, key: str, why: str) -> None:
        with self._lock:
            self.count += 1
            first = key not in self._logged
            if first and len(self._logged) < self.MAX_LOGGED:
                self._logged.add(key)
        if first:
            log.warning("skipping stored data the controller cannot read at %s: %s (counted; logged once)", key, why)


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            return None
    return str(value)


def _as_read(fields: dict[str, float]) -> dict[str, float]:
    return fields


def _numbers(raw: Mapping[object, object]) -> dict[str, float]:
    """A hash's fields as numbers; a field that is not one (hand-edited or corrupt data) is left out."""
    parsed = {}
    for name, value in raw.items():
        try:
            parsed[str(name)] = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
    return parsed


def _a_sample(agg: Aggregate) -> bool:
    """Does ``agg`` train the prior? Served traffic that speculated (not a worker's start-up timings)."""
    return agg.drafter != "none" and agg.rounds > 0 and not agg.start_up_timings
