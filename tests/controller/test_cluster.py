"""TelemetryStore on a local 3-master Redis Cluster (valkey-server in cluster mode, loopback ports): exact totals
under concurrent reporters and retries (on the cluster and on one server alike), the segment cap under a race for its
last places, a report cut short between its parts and then retried, and the keys spread over the nodes by segment
hash tag."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import RedisCluster

from controller.decision.counts import Aggregate
from controller.storage.redis_conn import make_client, make_cluster_client
from controller.storage.redis_schema import GLOBAL_TAG
from controller.storage.store import RedisClient, StoreConfig, TelemetryStore
from specd_api.segments import OVERFLOW_SEGMENT
from tests.controller.local_cluster import LocalCluster, cluster_mode_available, local_cluster
from tests.controller.test_store import T0, FakeClock, run_threads, small

MASTERS = 3
_unavailable = cluster_mode_available()
pytestmark = pytest.mark.skipif(_unavailable is not None, reason=f"no local Redis Cluster: {_unavailable}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    with local_cluster(tmp_path_factory.mktemp("cluster"), masters=MASTERS) as running:
        yield running


@pytest.fixture
def cluster_client(cluster: LocalCluster) -> Iterator[RedisCluster]:
    client = make_cluster_client(cluster.url, 10.0)
    yield client
    client.close()


@pytest.fixture
def cluster_prefix() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def make_store(client: RedisClient, prefix: str, **config: Any) -> TelemetryStore:
    return TelemetryStore(client, StoreConfig(prefix=prefix, **config), FakeClock())


def raw_counts(client: RedisClient, store: TelemetryStore, segment: str) -> dict[str, float]:
    raw = client.hgetall(store.keys.segment_bucket(segment, store.bucket(T0)))
    return {name: float(value) for name, value in raw.items() if name != "updated"}


# --- exact totals ----------------------------------------------------------------------------------------

THREADS = 8
REPORTS_EACH = 150
SEGMENTS = 40


def report(thread: int, n: int) -> list[Aggregate]:
    """Report n of one thread: three aggregates over segments spread by thread and n (two of them may coincide,
    so a report may hold one segment twice); rounds, K and the accepted length vary, so every field has its own
    total. All values are integers or multiples of 1/4: the float sums are exact."""
    segments = [
        f"s{(thread + n) % SEGMENTS}",
        f"s{(thread + 3 * n + 1) % SEGMENTS}",
        f"s{(5 * n + 2 * thread) % SEGMENTS}",
    ]
    return [
        small(segment, k=1 + (n + j) % 4, rounds=1 + (thread + n + j) % 5, accepted=(n + j) % (2 + (n + j) % 4))
        for j, segment in enumerate(segments)
    ]


def report_id(thread: int, n: int) -> str:
    return f"{thread}-{n}"


def expected_totals() -> dict[str, Counter[str]]:
    totals: dict[str, Counter[str]] = {}
    for thread in range(THREADS):
        for n in range(REPORTS_EACH):
            for agg in report(thread, n):
                totals.setdefault(agg.segment, Counter()).update({k: v for k, v in agg.segment_fields().items() if v})
    return totals


def client_for(url: str) -> RedisClient:
    return make_cluster_client(url, 10.0) if url.startswith("redis+cluster://") else make_client(url, 10.0)


@pytest.fixture(params=["one server", "cluster"])
def target_url(request: pytest.FixtureRequest, embedded_redis_url: str) -> str:
    return request.getfixturevalue("cluster").url if request.param == "cluster" else embedded_redis_url


def test_concurrent_reporters_with_retries_give_exact_totals(target_url: str, cluster_prefix: str) -> None:
    """THREADS reporters, each with its own client (like controller replicas): every 4th report is sent twice in a
    row, and every 10th is also sent by the next thread at about the same time (a concurrent retry)."""
    clients = [client_for(target_url) for _ in range(THREADS)]
    stores = [make_store(c, cluster_prefix) for c in clients]
    fresh = [0] * THREADS
    duplicates = [0] * THREADS
    lock = threading.Lock()

    def send(index: int, rid: str, aggregates: list[Aggregate]) -> None:
        result = stores[index].ingest(rid, aggregates)
        with lock:
            if result.duplicate:
                duplicates[index] += 1
            else:
                fresh[index] += 1

    def reporter(index: int) -> None:
        for n in range(REPORTS_EACH):
            send(index, report_id(index, n), report(index, n))
            if n % 4 == 0:
                send(index, report_id(index, n), report(index, n))
            if n % 10 == 0:
                other = (index - 1) % THREADS
                send(index, report_id(other, n), report(other, n))

    try:
        run_threads(THREADS, reporter)
        unique = THREADS * REPORTS_EACH
        sends = unique + THREADS * len(range(0, REPORTS_EACH, 4)) + THREADS * len(range(0, REPORTS_EACH, 10))
        assert sum(fresh) == unique, "each report was new to exactly one delivery"
        assert sum(fresh) + sum(duplicates) == sends
        want = expected_totals()
        got = {segment: raw_counts(clients[0], stores[0], segment) for segment in want}
        assert got == {segment: dict(counts) for segment, counts in want.items()}, "exact totals per field"
        snapshot = stores[0].read_snapshot(sorted(want))
        total_rounds = sum(c.rounds for c in snapshot.segments.values())
        assert total_rounds == sum(want[s]["k|draft|" + k + "|rounds"] for s in want for k in "1234")
        where = f"{MASTERS}-master cluster" if target_url.startswith("redis+cluster://") else "one server"
        print(
            f"\n{where}, exact totals: {THREADS} reporters, {unique} reports "
            f"({sends - unique} resent with the same id), {len(want)} segments, {total_rounds:.0f} rounds: "
            f"{sum(fresh)} new, {sum(duplicates)} duplicates, every field total exact"
        )
    finally:
        for key in list(clients[0].scan_iter(f"{cluster_prefix}:*", count=1000)):
            clients[0].delete(key)
        for c in clients:
            c.close()


def test_segment_cap_is_exact_under_a_race_for_the_last_places(
    cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    cap = 10
    stores = [make_store(cluster_client, cluster_prefix, max_segments=cap) for _ in range(4)]

    def reporter(index: int) -> None:
        for n in range(10):  # 40 new segments race for 10 places
            stores[index].ingest(f"{index}-{n}", [small(f"new{index}-{n}", rounds=1)])

    run_threads(4, reporter)
    active = stores[0].active_segments()
    assert len([s for s in active if s != OVERFLOW_SEGMENT]) == cap
    assert OVERFLOW_SEGMENT in active
    counts = stores[0].read_snapshot(active).segments
    assert sum(c.rounds for c in counts.values()) == 40, "every round counted, either as itself or as overflow"
    assert counts[OVERFLOW_SEGMENT].rounds == 40 - cap


# --- a report cut short between its parts ----------------------------------------------------------------


class Cut(Exception):
    """The connection was lost after some parts of a report."""


@pytest.fixture(params=["one server", "cluster"])
def any_target(request: pytest.FixtureRequest, embedded_redis_url: str) -> Iterator[tuple[RedisClient, str]]:
    """A client and a fresh key prefix, on the embedded server or on the cluster; the keys are deleted afterwards."""
    client: RedisClient
    if request.param == "cluster":
        client = make_cluster_client(request.getfixturevalue("cluster").url, 10.0)
    else:
        client = make_client(embedded_redis_url, 10.0)
    prefix = f"t{uuid.uuid4().hex[:12]}"
    yield client, prefix
    for key in list(client.scan_iter(f"{prefix}:*", count=1000)):
        client.delete(key)  # one at a time: on a cluster, one DEL takes keys of one slot only
    client.close()


def test_a_retry_completes_a_report_cut_short_and_counts_each_part_once(
    any_target: tuple[RedisClient, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    client, prefix = any_target
    aggregates = [small("a", rounds=2), small("b", rounds=3), small("c", rounds=5)]
    store = make_store(client, prefix)
    apply = store._ingest_segments

    def cut_after_one(calls: list[tuple[list[str], list[Any]]]) -> None:
        apply(calls[:1])
        raise Cut

    monkeypatch.setattr(store, "_ingest_segments", cut_after_one)
    with pytest.raises(Cut):
        store.ingest("r1", aggregates)
    after_cut = store.read_snapshot(["a", "b", "c"]).segments
    assert [after_cut[s].rounds for s in "abc"] == [2, 0, 0], "the global part and segment a landed, b and c not"
    retry = make_store(client, prefix).ingest("r1", aggregates)
    assert retry.duplicate, "the report id was seen (its global part was applied)"
    again = make_store(client, prefix).ingest("r1", aggregates)
    assert again.duplicate
    snapshot = make_store(client, prefix).read_snapshot(["a", "b", "c"])
    assert [snapshot.segments[s].rounds for s in "abc"] == [2, 3, 5], "each part counted exactly once"
    drafted = dict(snapshot.costs.drafted)
    assert drafted == {("draft", 1, "greedy"): 2 * 10}, "costs (the global part) counted once: K = 2"


# --- the keys spread over the cluster --------------------------------------------------------------------


def test_segments_spread_over_slots_and_nodes(
    cluster: LocalCluster, cluster_client: RedisCluster, cluster_prefix: str
) -> None:
    store = make_store(cluster_client, cluster_prefix)
    segments = [f"s{i}" for i in range(SEGMENTS)]
    for i, segment in enumerate(segments):
        store.ingest(f"r{i}", [small(segment, rounds=1)])
    bucket = store.bucket(T0)
    slot_of = {s: int(cluster_client.keyslot(store.keys.segment_bucket(s, bucket))) for s in segments}
    for s in segments:  # a segment's keys share its slot: its script touches one slot
        assert cluster_client.keyslot(store.keys.report(f"r{segments.index(s)}", s)) == slot_of[s]
    assert len(set(slot_of.values())) == len(segments), "40 segment tags, 40 slots"
    global_slots = {
        cluster_client.keyslot(k)
        for k in (store.keys.report("r0"), store.keys.segments(), store.keys.cost_bucket(bucket))
    }
    assert len(global_slots) == 1 and f"{{{GLOBAL_TAG}}}" in store.keys.samples()
    per_node = []
    for index in range(MASTERS):  # each master's own keys, asked directly
        node = cluster.node(index)
        per_node.append(sum(1 for _ in node.scan_iter(f"{cluster_prefix}:v1:seg:*", count=1000)))
        node.close()
    assert sum(per_node) == len(segments)
    assert all(n > 0 for n in per_node), f"segment hashes per master: {per_node}"
    assert len(list(cluster_client.scan_iter(f"{cluster_prefix}:v1:seg:*"))) == len(segments), "scan spans nodes"
    assert sorted(store.active_segments()) == sorted(segments)
    assert len(store.read_samples(100)) == len(segments)
    store.save_prior({"coefficients": [0.5]})
    assert store.read_prior() == {"coefficients": [0.5]}


def test_cluster_url_connects(cluster: LocalCluster) -> None:
    from controller.storage.redis_conn import connect

    handle = connect(cluster.url, Path("/nonexistent"), 2.0)
    try:
        assert isinstance(handle.client, RedisCluster)
        assert handle.client.ping()
        assert len(handle.client.get_primaries()) == MASTERS
    finally:
        handle.close()


def test_cluster_down_at_start_up_is_a_clear_error() -> None:
    from controller.storage.redis_conn import RedisSetupError

    with pytest.raises(RedisSetupError, match="no usable cluster"):
        make_cluster_client("redis+cluster://127.0.0.1:1", 0.5)


def test_a_server_that_lost_its_scripts_still_ingests(any_target: tuple[RedisClient, str]) -> None:
    """A restarted or promoted node has an empty script cache: the first report after it answers NOSCRIPT."""
    client, prefix = any_target
    store = make_store(client, prefix)
    store.ingest("before", [small("a", rounds=2), small("b", rounds=3)])
    client.script_flush()  # every primary, on a cluster
    store.ingest("after", [small("a", rounds=5), small("b", rounds=7)])
    store.ingest("after", [small("a", rounds=5), small("b", rounds=7)])
    counts = store.read_snapshot(["a", "b"]).segments
    assert (counts["a"].rounds, counts["b"].rounds) == (7, 10)
