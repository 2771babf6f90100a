"""TelemetryStore against real servers: the key schema, exact counts, dedup, the segment cap, decay, and
exact totals under concurrent reporters (embedded valkey and, when it answers, the local Redis)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from controller.decision.counts import Aggregate, KCounts, PositionCounts
from controller.storage.redis_conn import make_client
from controller.storage.store import StoreConfig, TelemetryStore
from specd_api.segments import OVERFLOW_SEGMENT

T0 = 1_000_000.0  # a bucket boundary for every bucket_seconds used here


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_store(client: redis.Redis, prefix: str, clock: Callable[[], float], **config: Any) -> TelemetryStore:
    return TelemetryStore(client, StoreConfig(prefix=prefix, **config), clock)


def four_rounds(segment: str = "chat", drafter: str = "draft") -> Aggregate:
    """K = 3, four rounds that accepted 3, 1, 0 and 2 tokens; the 0-round's drafter stopped after 2 proposals.

    Position i is verified when positions < i were all accepted: (4, 3, 2); accepted at i: (3, 2, 1).
    At position 2 the four position counters (offered 4, proposed 3, verified 2, accepted 1) all differ,
    so a swapped field name cannot pass.
    """
    return Aggregate(
        segment=segment,
        drafter=drafter,
        k=3,
        rounds=4,
        num_drafted=11,
        num_accepted=6,
        proposed_per_position=(4, 4, 3),
        verified_per_position=(4, 3, 2),
        accepted_per_position=(3, 2, 1),
        tokens_emitted=10,  # accepted + one bonus token per round
        draft_seconds=0.5,
        verify_seconds=0.75,
        batch_size=3,
        by_drafted=((0, 0.0), (0, 0.0), (1, 0.125), (3, 0.625)),  # one round drafted 2, three drafted 3
    )


def small(segment: str = "chat", k: int = 2, rounds: int = 1, accepted: int = 1) -> Aggregate:
    """A tiny aggregate: ``rounds`` rounds of K = ``k``, the first ``accepted`` positions kept."""
    return Aggregate(
        segment=segment,
        drafter="draft",
        k=k,
        rounds=rounds,
        num_drafted=rounds * k,
        num_accepted=rounds * accepted,
        proposed_per_position=(rounds,) * k,
        verified_per_position=tuple(rounds if i <= accepted else 0 for i in range(k)),
        accepted_per_position=tuple(rounds if i < accepted else 0 for i in range(k)),
        tokens_emitted=rounds * (accepted + 1),
        draft_seconds=0.25 * rounds,  # powers of two: sums stay exact in floating point
        verify_seconds=0.5 * rounds,
        batch_size=1,
    )


def raw_bucket(client: redis.Redis, store: TelemetryStore, segment: str, now: float = T0) -> dict[str, float]:
    """The segment's hash in the current bucket, straight from Redis (no parsing by the code under test)."""
    raw = client.hgetall(store.keys.segment_bucket(segment, store.bucket(now)))
    return {name: float(value) for name, value in raw.items() if name != "updated"}


# --- ingest and read back ----------------------------------------------------------------------------


def test_ingest_writes_the_documented_fields(redis_client: redis.Redis, prefix: str) -> None:
    store = make_store(redis_client, prefix, FakeClock())
    result = store.ingest("r1", [four_rounds()])
    assert (result.rounds, result.duplicate) == (4, False)
    bucket = int(T0 // 60)
    assert redis_client.exists(f"{prefix}:v1:seg:{{chat}}:{bucket}"), "key schema P:v1:seg:{S}:{bucket}, S hash tag"
    assert raw_bucket(redis_client, store, "chat") == {
        "k|draft|3|rounds": 4,
        "k|draft|3|proposed": 11,
        "k|draft|3|accepted": 6,
        "k|draft|3|tokens": 10,
        "k|draft|3|draft_s": 0.5,
        "k|draft|3|verify_s": 0.75,
        **{f"p|draft|{i}|offered": 4 for i in range(3)},  # every round had K = 3 > i
        "p|draft|0|proposed": 4,
        "p|draft|1|proposed": 4,
        "p|draft|2|proposed": 3,
        "p|draft|0|verified": 4,
        "p|draft|1|verified": 3,
        "p|draft|2|verified": 2,
        "p|draft|0|accepted": 3,
        "p|draft|1|accepted": 2,
        "p|draft|2|accepted": 1,
    }
    assert float(redis_client.hget(f"{prefix}:v1:seg:{{chat}}:{bucket}", "updated")) == T0


def test_snapshot_reads_back_exact_counts(redis_client: redis.Redis, prefix: str) -> None:
    store = make_store(redis_client, prefix, FakeClock())
    store.ingest("r1", [four_rounds()])
    snapshot = store.read_snapshot(["chat"])
    counts = snapshot.segments["chat"]
    assert counts.by_k[("draft", 3)] == KCounts(
        rounds=4, proposed=11, accepted=6, tokens=10, draft_s=0.5, verify_s=0.75
    )
    assert counts.position_list("draft") == [
        PositionCounts(offered=4, proposed=4, verified=4, accepted=3),
        PositionCounts(offered=4, proposed=4, verified=3, accepted=2),
        PositionCounts(offered=4, proposed=3, verified=2, accepted=1),
    ]
    assert counts.last_update == T0
    # Costs: drafting 0.5 s for 11 tokens; verification of round(11 / 4) = 3 drafts at batch 3 -> bucket 4.
    # costs per batch bucket (batch 3 is in bucket 4): drafting per token, verification per number drafted n
    # (a greedy request's: each sampling mode's costs are their own)
    assert dict(snapshot.costs.draft_s) == {("draft", 4, "greedy"): 0.5}
    assert dict(snapshot.costs.drafted) == {("draft", 4, "greedy"): 11}
    assert dict(snapshot.costs.verify_s) == {(2, 4, "greedy"): 0.125, (3, 4, "greedy"): 0.625}
    assert dict(snapshot.costs.verify_rounds) == {(2, 4, "greedy"): 1, (3, 4, "greedy"): 3}


def test_positions_pool_over_k_and_k_fields_do_not(redis_client: redis.Redis, prefix: str) -> None:
    store = make_store(redis_client, prefix, FakeClock())
    store.ingest("r1", [small(k=2, rounds=5, accepted=2), small(k=4, rounds=3, accepted=1)])
    counts = store.read_snapshot(["chat"]).segments["chat"]
    assert counts.by_k[("draft", 2)].rounds == 5
    assert counts.by_k[("draft", 4)].rounds == 3
    offered = [p.offered for p in counts.position_list("draft")]
    assert offered == [8, 8, 3, 3], "positions 0-1 offered by both K; 2-3 only by K = 4"
    accepted = [p.accepted for p in counts.position_list("draft")]
    assert accepted == [8, 5, 0, 0], "K=2 kept both positions (5 rounds); K=4 kept position 0 (3 rounds)"


def test_segments_and_reports_do_not_mix(redis_client: redis.Redis, prefix: str) -> None:
    store = make_store(redis_client, prefix, FakeClock())
    store.ingest("r1", [small("chat", rounds=2)])
    store.ingest("r2", [small("code", rounds=7)])
    store.ingest("r3", [small("chat", rounds=3)])
    snapshot = store.read_snapshot(["chat", "code", "never-seen"])
    assert snapshot.segments["chat"].rounds == 5
    assert snapshot.segments["code"].rounds == 7
    assert snapshot.segments["never-seen"].rounds == 0
    assert sorted(store.active_segments()) == ["chat", "code"]


# --- dedup and the segment cap -----------------------------------------------------------------------


def test_same_report_id_counts_once(redis_client: redis.Redis, prefix: str) -> None:
    store = make_store(redis_client, prefix, FakeClock())
    first = store.ingest("r1", [four_rounds()])
    again = store.ingest("r1", [four_rounds()])
    other_payload = store.ingest("r1", [small(rounds=100)])  # a reused id changes nothing, whatever it carries
    assert (first.duplicate, again.duplicate, other_payload.duplicate) == (False, True, True)
    assert (again.rounds, other_payload.rounds) == (0, 0)
    assert raw_bucket(redis_client, store, "chat")["k|draft|3|rounds"] == 4
    assert "k|draft|2|rounds" not in raw_bucket(redis_client, store, "chat")
    assert redis_client.ttl(store.keys.report("r1")) > 0, "dedup markers expire (the global part's)"
    assert redis_client.ttl(store.keys.report("r1", "chat")) > 0, "dedup markers expire (the segment part's)"


def test_a_dedup_marker_outlives_an_hour_long_outage(redis_client: redis.Redis, prefix: str) -> None:
    # A worker retries an unacknowledged report with the same id for as long as it takes (a controller restart, a
    # Redis outage), so the marker must outlive such an outage, or the retry after it counts twice.
    store = make_store(redis_client, prefix, FakeClock())
    store.ingest("r1", [four_rounds()])
    for marker in (store.keys.report("r1"), store.keys.report("r1", "chat")):  # global part, segment part
        ttl = redis_client.ttl(marker)
        assert ttl >= 3600 - 5, f"the dedup marker {marker} expires after {ttl} s"


@pytest.mark.parametrize(
    ("segment", "counted_as", "why"),
    [
        ("a", "a", "known segment keeps its own name although the cap is reached"),
        ("b", "b", "the other known segment, likewise"),
        ("c", OVERFLOW_SEGMENT, "a third new segment is over max_segments = 2"),
    ],
)
def test_segment_cap_sends_new_segments_to_overflow(
    redis_client: redis.Redis, prefix: str, segment: str, counted_as: str, why: str
) -> None:
    store = make_store(redis_client, prefix, FakeClock(), max_segments=2)
    store.ingest("setup-a", [small("a", rounds=1)])
    store.ingest("setup-b", [small("b", rounds=1)])
    before = store.read_snapshot([counted_as]).segments[counted_as].rounds
    store.ingest("probe", [small(segment, rounds=9)])
    after = store.read_snapshot([counted_as, segment]).segments
    assert after[counted_as].rounds == before + 9, why
    if counted_as != segment:
        assert after[segment].rounds == 0, "the capped segment gets no hash of its own"


def test_overflow_collects_every_segment_beyond_the_cap(redis_client: redis.Redis, prefix: str) -> None:
    store = make_store(redis_client, prefix, FakeClock(), max_segments=2)
    for i, segment in enumerate(["a", "b", "c", "d", "a", "e"]):
        store.ingest(f"r{i}", [small(segment, rounds=i + 1)])
    rounds = {s: c.rounds for s, c in store.read_snapshot(["a", "b", OVERFLOW_SEGMENT]).segments.items()}
    assert rounds == {"a": 1 + 5, "b": 2, OVERFLOW_SEGMENT: 3 + 4 + 6}
    assert sorted(store.active_segments()) == sorted(["a", "b", OVERFLOW_SEGMENT])


# --- decay and the window ----------------------------------------------------------------------------

# bucket_seconds = half_life = 10, window = 4 buckets. K = 1 holds 8 rounds in bucket b0 = [T0, T0+10);
# K = 2 holds 4 rounds in bucket b0+1. A bucket's age is counted from its end, so it weighs 1 until it closes.
DECAY_ROWS = [
    (0.0, 8.0, 0.0, "b0 is current: weight 1; b0+1 does not exist yet"),
    (10.0, 8.0, 4.0, "b0 just closed (age 0): still weight 1; b0+1 is current"),
    (20.0, 4.0, 4.0, "b0 is one half-life older than b0+1: weight 0.5"),
    (30.0, 2.0, 2.0, "two and one half-lives: 0.25 and 0.5"),
    (40.0, 0.0, 1.0, "b0 left the 4-bucket window [b0+1, b0+4]: gone; b0+1 weighs 0.25"),
    (60.0, 0.0, 0.0, "both out of the window"),
]


@pytest.mark.parametrize(("elapsed", "k1_rounds", "k2_rounds", "why"), DECAY_ROWS)
def test_buckets_decay_by_half_life(
    redis_client: redis.Redis, prefix: str, elapsed: float, k1_rounds: float, k2_rounds: float, why: str
) -> None:
    clock = FakeClock(T0)
    store = make_store(redis_client, prefix, clock, bucket_seconds=10, half_life_seconds=10, window_buckets=4)
    store.ingest("old", [small(k=1, rounds=8)])
    if elapsed >= 10:
        clock.now = T0 + 10
        store.ingest("new", [small(k=2, rounds=4)])
    clock.now = T0 + elapsed
    counts = store.read_snapshot(["chat"]).segments["chat"]
    assert (counts.by_k[("draft", 1)].rounds, counts.by_k[("draft", 2)].rounds) == (k1_rounds, k2_rounds), why


def test_closed_buckets_decay_continuously_within_the_current_bucket(redis_client: redis.Redis, prefix: str) -> None:
    clock = FakeClock(T0)
    store = make_store(redis_client, prefix, clock, bucket_seconds=10, half_life_seconds=10, window_buckets=4)
    store.ingest("old", [small(rounds=8)])
    clock.now = T0 + 15  # b0 closed 5 s ago: half a half-life
    assert store.read_snapshot(["chat"]).segments["chat"].rounds == pytest.approx(8 * 2**-0.5, rel=1e-12)


def test_a_decay_step_holds_every_weight_until_the_next_step(redis_client: redis.Redis, prefix: str) -> None:
    """The controller's setting (one step a bucket): a refresh that finds no new report finds the same counts."""
    clock = FakeClock(T0)
    store = make_store(redis_client, prefix, clock, bucket_seconds=10, half_life_seconds=10, window_buckets=4,
                       decay_step_seconds=10)  # fmt: skip
    store.ingest("old", [small(rounds=8)])
    seen = []
    for elapsed in (10.0, 15.0, 19.9, 20.0, 29.9):
        clock.now = T0 + elapsed
        seen.append(store.read_snapshot(["chat"]).segments["chat"].rounds)
    assert seen == [8.0, 8.0, 8.0, 4.0, 4.0], "read at 10 s, then at 20 s: b0's age is 0, then one half-life"


def test_a_segment_read_from_the_same_fields_keeps_its_counts_object(redis_client: redis.Redis, prefix: str) -> None:
    """What tells the learner that a refresh moved nothing in a segment (its tables are then kept)."""
    clock = FakeClock(T0 + 5)
    store = make_store(redis_client, prefix, clock, bucket_seconds=10, decay_step_seconds=10)
    store.ingest("r1", [small("a"), small("b")])
    first = store.read_snapshot(["a", "b"])
    clock.now = T0 + 9
    again = store.read_snapshot(["a", "b"], previous=first)
    assert again.segments["a"] is first.segments["a"] and again.segments["b"] is first.segments["b"]
    store.ingest("r2", [small("b")])
    after = store.read_snapshot(["a", "b"], previous=again)
    assert after.segments["a"] is first.segments["a"], "no report: the same counts"
    assert (
        after.segments["b"] is not first.segments["b"] and after.segments["b"].rounds == 2 * first.segments["b"].rounds
    )
    clock.now = T0 + 10
    stepped = store.read_snapshot(["a", "b"], previous=after)
    assert stepped.segments["a"] is not first.segments["a"], "a new decay step reads every segment again"
    assert stepped.segments["a"] == first.segments["a"], "b0 just closed: its weight is still 1"


def test_active_segments_follow_the_window(redis_client: redis.Redis, prefix: str) -> None:
    clock = FakeClock(T0)
    store = make_store(redis_client, prefix, clock, bucket_seconds=10, window_buckets=4)
    store.ingest("r1", [small("quiet")])
    clock.now = T0 + 30
    store.ingest("r2", [small("busy")])
    assert sorted(store.active_segments()) == ["busy", "quiet"], "quiet reported 30 s ago, inside 40 s"
    clock.now = T0 + 41
    assert store.active_segments() == ["busy"], "quiet's last report is now older than the 40 s window"


# --- concurrency ---------------------------------------------------------------------------------------

REPORTERS = 16
REPORTS_EACH = 1_000


def run_threads(count: int, work: Callable[[int], None]) -> None:
    """Start ``count`` threads on ``work(index)`` together; re-raise the first failure."""
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def body(index: int) -> None:
        try:
            start.wait()
            work(index)
        except BaseException as e:  # collected and re-raised in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a reporter hung"
    if errors:
        raise errors[0]


@pytest.fixture
def clients(redis_url: str) -> Iterator[list[redis.Redis]]:
    """One client (own connection pool) per reporter, like separate controller replicas."""
    made = [make_client(redis_url, 10.0) for _ in range(REPORTERS)]
    yield made
    for c in made:
        c.close()


def test_concurrent_reporters_lose_no_increment(
    redis_client: redis.Redis, prefix: str, clients: list[redis.Redis]
) -> None:
    clock = FakeClock()  # frozen: every report lands in the same bucket
    stores = [make_store(c, prefix, clock) for c in clients]
    # Each report: 1 round at K = 2 with only position 0 accepted, so each position counter has its own total.
    report = [small("hot", k=2, rounds=1, accepted=1)]

    def reporter(index: int) -> None:
        for n in range(REPORTS_EACH):
            assert not stores[index].ingest(f"{index}-{n}", report).duplicate

    run_threads(REPORTERS, reporter)
    total = REPORTERS * REPORTS_EACH
    fields = raw_bucket(redis_client, stores[0], "hot")
    assert fields == {
        "k|draft|2|rounds": total,
        "k|draft|2|proposed": 2 * total,
        "k|draft|2|accepted": total,
        "k|draft|2|tokens": 2 * total,
        "k|draft|2|draft_s": 0.25 * total,
        "k|draft|2|verify_s": 0.5 * total,
        "p|draft|0|offered": total,
        "p|draft|0|proposed": total,
        "p|draft|0|verified": total,
        "p|draft|0|accepted": total,
        "p|draft|1|offered": total,
        "p|draft|1|proposed": total,
        "p|draft|1|verified": total,  # position 0 was accepted every time
        # p|draft|1|accepted: 0 each time; zero increments are not written
    }


def test_concurrent_duplicate_delivery_counts_once(
    redis_client: redis.Redis, prefix: str, clients: list[redis.Redis]
) -> None:
    ids = [f"dup-{n}" for n in range(200)]
    senders = 4
    stores = [make_store(c, prefix, FakeClock()) for c in clients[:senders]]
    fresh = [0] * senders

    def sender(index: int) -> None:
        for report_id in ids:
            if not stores[index].ingest(report_id, [small("dup", rounds=3)]).duplicate:
                fresh[index] += 1

    run_threads(senders, sender)
    assert sum(fresh) == len(ids), "exactly one sender was told each report was new"
    assert raw_bucket(redis_client, stores[0], "dup")["k|draft|2|rounds"] == 3 * len(ids)
