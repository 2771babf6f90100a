"""A report's increments summed per hash field (storage/report_increments.py) against the per-aggregate fields
they replace (Aggregate.segment_fields, calibration_fields, cost_fields, added one by one), in
memory and as stored in Redis; and the Redis work of a report at the size bound."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest
import redis

from controller.decision.counts import Aggregate
from controller.storage.redis_conn import make_client
from controller.storage.report_increments import cost_increments, segment_increments
from controller.storage.store import StoreConfig, TelemetryStore
from specd_api.checks import MAX_AGGREGATES, MAX_REPORT_POSITIONS

SEGMENTS = ("chat", "code", "sql/queries")
DRAFTERS = ("draft", "prompt_lookup", "suffix", "none")
NOW = 1_000_000.0


def step_seconds(segment: str, batch_size: int) -> float:
    """A plain step's seconds that differs by segment and batch size, and is unknown (0) for one pair."""
    return 0.0 if (segment, batch_size) == ("sql/queries", 16) else 0.01 * (1 + SEGMENTS.index(segment)) * batch_size


def random_aggregate(rng: random.Random) -> Aggregate:
    """Any mix the store may see: served, counterfactual and start-up timings; K 0..8 with position lists shorter
    than K; per-n tables with empty entries and seconds without rounds; several batch buckets; with and without an
    expected speedup."""
    drafter = rng.choice(DRAFTERS)
    k = 0 if drafter == "none" else rng.randint(1, 8)
    counterfactual = drafter != "none" and rng.random() < 0.2
    start_up_timings = not counterfactual and rng.random() < 0.1
    rounds = rng.choice((0, rng.randint(1, 60)))
    proposed = sorted((rng.randint(0, rounds) for _ in range(rng.randint(0, k))), reverse=True)
    verified = [rng.randint(0, p) for p in proposed]
    accepted = [rng.randint(0, v) for v in verified]
    by_drafted: tuple[tuple[int, float], ...] = ()
    if not counterfactual:
        by_drafted = tuple(
            (r, r * rng.uniform(0.001, 0.05) if r or rng.random() < 0.9 else 0.3)
            for r in (rng.choice((0, rng.randint(1, 20))) for _ in range(rng.randint(0, k + 1)))
        )
    return Aggregate(
        segment=rng.choice(SEGMENTS),
        drafter=drafter,
        k=k,
        rounds=rounds,
        num_drafted=sum(proposed),
        num_accepted=sum(accepted),
        proposed_per_position=tuple(proposed),
        verified_per_position=tuple(verified),
        accepted_per_position=tuple(accepted),
        tokens_emitted=sum(accepted) + rounds,
        draft_seconds=rng.choice((0.0, rng.uniform(0.0, 0.5))),
        verify_seconds=sum(s for _, s in by_drafted),
        batch_size=rng.choice((1, 2, 5, 16)),
        by_drafted=by_drafted,
        counterfactual=counterfactual,
        expected_speedup=rng.choice((0.0, 1.5, 2.5)),
        start_up_timings=start_up_timings,
        request_tokens_emitted=0,
        request_seconds=0.0,
    )


def report(seed: int, size: int = 200) -> list[Aggregate]:
    rng = random.Random(seed)
    return [random_aggregate(rng) for _ in range(size)]


def per_aggregate_segments(aggregates: list[Aggregate]) -> dict[str, dict[str, float]]:
    """The reference: each aggregate's segment and calibration fields, zeros dropped, added in report order (what
    the store sent to Redis, one aggregate after another, before the sums)."""
    totals: dict[str, dict[str, float]] = {}
    for a in aggregates:
        part = totals.setdefault(a.segment, {})
        for name, value in (a.segment_fields() | a.calibration_fields(step_seconds(a.segment, a.batch_size))).items():
            if value:
                part[name] = part.get(name, 0.0) + value
    return totals


def per_aggregate_costs(aggregates: list[Aggregate]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for a in aggregates:
        for name, value in a.cost_fields().items():
            totals[name] = totals.get(name, 0.0) + value
    return {name: value for name, value in totals.items() if value}


@pytest.mark.parametrize("seed", range(12))
def test_a_reports_sums_are_its_aggregates_fields_added_one_by_one(seed: int) -> None:
    aggregates = report(seed)
    # the same additions in the same order: equal to the last bit, seconds included
    assert segment_increments(aggregates, step_seconds) == per_aggregate_segments(aggregates)
    assert cost_increments(aggregates) == per_aggregate_costs(aggregates)


def test_without_step_seconds_no_calibration_field_is_written() -> None:
    aggregates = report(3)
    sums = segment_increments(aggregates)
    assert not any(name.startswith("cal|") for fields in sums.values() for name in fields)
    assert any(
        name.startswith("cal|") for fields in segment_increments(aggregates, step_seconds).values() for name in fields
    )


def test_a_segment_with_start_up_timings_only_has_an_empty_part() -> None:
    timings = Aggregate("boot", "draft", 2, 5, 10, 4, (5, 5), (5, 3), (3, 1), 9, 0.1, 0.2, 1,
                        by_drafted=((0, 0.0), (0, 0.0), (5, 0.2)), start_up_timings=True)  # fmt: skip
    assert segment_increments([timings], step_seconds) == {"boot": {}}
    assert cost_increments([timings])  # its timings are costs


# --- in Redis -----------------------------------------------------------------------------------------


@pytest.fixture
def client(embedded_redis_url: str) -> Iterator[redis.Redis]:
    """The embedded server only: its command counters are this run's alone."""
    c = make_client(embedded_redis_url, 5.0)
    yield c
    c.close()


def stored(client: redis.Redis, store: TelemetryStore) -> dict[str, float]:
    """Every segment bucket hash and the cost hash of the current bucket, by '<segment or #cost> <field>'."""
    bucket = store.bucket(NOW)
    hashes = {s: store.keys.segment_bucket(s, bucket) for s in SEGMENTS} | {"#cost": store.keys.cost_bucket(bucket)}
    return {
        f"{owner} {name}": float(value)
        for owner, key in hashes.items()
        for name, value in client.hgetall(key).items()
        if name != "updated"
    }


def store_one_by_one(client: redis.Redis, store: TelemetryStore, aggregates: list[Aggregate]) -> None:
    """The reference writer: one HINCRBYFLOAT per aggregate and nonzero field, as the segment script did before."""
    bucket = store.bucket(NOW)
    pipe = client.pipeline(transaction=False)
    for a in aggregates:
        fields = a.segment_fields() | a.calibration_fields(step_seconds(a.segment, a.batch_size))
        for name, value in fields.items():
            if value and not a.start_up_timings:
                pipe.hincrbyfloat(store.keys.segment_bucket(a.segment, bucket), name, value)
    for name, value in per_aggregate_costs(aggregates).items():
        pipe.hincrbyfloat(store.keys.cost_bucket(bucket), name, value)
    pipe.execute()


@pytest.mark.parametrize("seed", range(4))
def test_the_stored_counts_are_those_of_adding_aggregate_by_aggregate(client: redis.Redis, seed: int) -> None:
    aggregates = [a for a in report(seed) if not a.start_up_timings]  # a segment of start-up timings only: none
    summed = TelemetryStore(client, StoreConfig(prefix=f"sum{seed}"), lambda: NOW)
    one_by_one = TelemetryStore(client, StoreConfig(prefix=f"one{seed}"), lambda: NOW)
    try:
        summed.ingest("r", aggregates, step_seconds)
        store_one_by_one(client, one_by_one, aggregates)
        expected, got = stored(client, one_by_one), stored(client, summed)
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            # counts exactly; seconds up to Redis's rounding of each addition (long double, 17 digits)
            assert math.isclose(got[name], value, rel_tol=1e-12), name
            if name.split("|")[-1] in ("rounds", "proposed", "accepted", "verified", "offered", "tokens", "n", "r"):
                assert got[name] == value, name
    finally:
        for prefix in (f"sum{seed}", f"one{seed}"):
            keys = list(client.scan_iter(f"{prefix}:*"))
            if keys:
                client.delete(*keys)


def at_the_bounds() -> list[Aggregate]:
    """MAX_AGGREGATES aggregates at K 32 over 16 segments, every position and per-n entry filled (the attack of
    benchmarks/controller_scale.py's big-reports, as validated aggregates)."""
    k = MAX_REPORT_POSITIONS // MAX_AGGREGATES
    proposed = tuple(1_000 - 10 * i for i in range(k))
    accepted = tuple(p * 7 // 10 for p in proposed)
    verified = (proposed[0], *(min(a, p) for a, p in zip(accepted, proposed[1:], strict=False)))
    by_drafted = tuple((10 + n, 0.0125 * (10 + n)) for n in range(k + 1))
    return [
        Aggregate(
            f"bulk-{i % 16:02d}",
            "draft",
            k,
            1_000,
            sum(proposed),
            sum(accepted),
            proposed,
            verified,
            accepted,
            sum(accepted) + 1_000,
            0.5,
            sum(s for _, s in by_drafted),
            1,
            by_drafted=by_drafted,
        )
        for i in range(MAX_AGGREGATES)
    ]


def hincrbyfloat_calls(client: redis.Redis) -> int:
    stats = client.info("commandstats").get("cmdstat_hincrbyfloat", {})
    return int(stats.get("calls", 0))


def test_a_report_at_the_bounds_writes_each_field_once(client: redis.Redis) -> None:
    """Redis work per report (contract 10): one HINCRBYFLOAT per field of each hash it touches, not one per aggregate
    and field (134,000 for this report before the sums, 0.4 s of Redis inside one script)."""
    aggregates = at_the_bounds()
    store = TelemetryStore(client, StoreConfig(prefix="bounds"), lambda: NOW)
    try:
        before = hincrbyfloat_calls(client)
        store.ingest("big", aggregates)
        calls = hincrbyfloat_calls(client) - before
        # 16 segments x (6 K fields + 32 positions x 4 + one plain-step bin); the cost hash: 2 drafting fields and
        # one bin, 33 n x (seconds, rounds, one bin)
        assert calls == 16 * (6 + 32 * 4 + 1) + 2 + 1 + 33 * 3
        counted = {s: store.keys.segment_bucket(s, store.bucket(NOW)) for s in {a.segment for a in aggregates}}
        assert float(client.hget(counted["bulk-00"], "p|draft|0|offered")) == 1_000 * (MAX_AGGREGATES // 16 + 1)
    finally:
        keys = list(client.scan_iter("bounds:*"))
        if keys:
            client.delete(*keys)
