"""Upgrading the keys a controller before hash tags stored (``P:v1:seg:chat:b`` …) to the tagged names: learning,
the segment cap, the samples and the dedup markers carry over, merged with whatever the new layout already holds."""

from __future__ import annotations

import json

import redis

from controller.storage.redis_schema import GLOBAL_TAG
from controller.storage.store import StoreConfig, TelemetryStore
from tests.controller.test_store import T0, FakeClock, raw_bucket, small


def write_untagged_layout(client: redis.Redis, prefix: str, bucket: int) -> None:
    """What the single-script store wrote for report "old-1" (segment chat:eu, 4 rounds) at T0."""
    seg = f"{prefix}:v1:seg:chat:eu:{bucket}"  # a segment name may hold ':'
    client.hset(seg, mapping={"k|draft|2|rounds": 4, "p|draft|0|offered": 4, "updated": T0, "junk": "x"})
    client.expire(seg, 3000)
    client.zadd(f"{prefix}:v1:segments", {"chat:eu": T0})
    client.hset(f"{prefix}:v1:cost:{bucket}", mapping={"e|draft|1|s": 1.0, "e|draft|1|n": 8})
    client.expire(f"{prefix}:v1:cost:{bucket}", 3000)
    client.rpush(f"{prefix}:v1:samples", old_row(2), old_row(1))
    client.set(f"{prefix}:v1:report:old-1", "1", ex=3000)
    client.set(f"{prefix}:v1:prior", '{"kept": true}')


def test_untagged_keys_move_and_merge(redis_client: redis.Redis, prefix: str) -> None:
    clock = FakeClock(T0 + 5)
    store = TelemetryStore(redis_client, StoreConfig(prefix=prefix, samples_max=3), clock)
    bucket = store.bucket(T0)
    write_untagged_layout(redis_client, prefix, bucket)
    store.ingest("new-1", [small("chat:eu", k=2, rounds=3)])  # the new layout already has some of the same bucket

    assert store.upgrade_untagged_keys() == 5, "seg hash, segments, cost hash, samples, one report marker"
    assert store.upgrade_untagged_keys() == 0, "nothing left to move"
    assert sorted(redis_client.scan_iter(f"{prefix}:v1:*")) == sorted(
        [
            store.keys.segment_bucket("chat:eu", bucket),
            store.keys.segments(),
            store.keys.changes(),
            store.keys.change_state(),
            store.keys.cost_bucket(bucket),
            store.keys.samples(),
            store.keys.report("old-1"),
            store.keys.report("new-1"),
            store.keys.report("new-1", "chat:eu"),
            f"{prefix}:v1:prior",
        ]
    )
    fields = raw_bucket(redis_client, store, "chat:eu", T0)
    assert fields["k|draft|2|rounds"] == 4 + 3, "counts added"
    assert fields["p|draft|0|offered"] == 4 + 3
    assert "junk" not in redis_client.hgetall(store.keys.segment_bucket("chat:eu", bucket)), "a non-number is dropped"
    assert float(redis_client.hget(store.keys.segment_bucket("chat:eu", bucket), "updated")) == T0 + 5, "the later time"
    assert 2990 < redis_client.ttl(store.keys.segment_bucket("chat:eu", bucket)) <= 3660, "the longer TTL"
    assert store.active_segments() == ["chat:eu"]
    drafted = dict(store.read_snapshot(["chat:eu"]).costs.drafted)
    assert drafted[("draft", 1, "greedy")] == 8 + 6, "old costs + new (3 x K 2)"
    samples = store.read_samples(10)
    assert len(samples) == 3 and [s["at"] for s in samples[1:]] == [2, 1], "newest first, trimmed to samples_max"
    assert redis_client.ttl(store.keys.report("old-1")) > 2990
    assert store.read_prior() == {"kept": True}

    retry = store.ingest("old-1", [small("chat:eu", k=2, rounds=4)])  # a worker retries a report acked before
    assert retry.duplicate, "the old dedup marker still guards its report"
    assert raw_bucket(redis_client, store, "chat:eu", T0)["k|draft|2|rounds"] == 7, "and nothing is counted twice"
    assert f"{{{GLOBAL_TAG}}}" in store.keys.report("old-1")


def test_an_unreachable_redis_does_not_stop_a_start(caplog) -> None:
    from controller.storage.redis_conn import make_client
    from controller.storage.store import upgrade_keys

    store = TelemetryStore(make_client("redis://127.0.0.1:1/0", 0.3), StoreConfig(prefix="unused"), FakeClock())
    upgrade_keys(store)  # a start with Redis down goes on (contract 3)
    assert "a later start will" in caplog.text


def old_row(at: int) -> str:
    """A training row as a controller before hash tags stored it (``at`` tells them apart)."""
    return json.dumps({"drafter": "draft", "temperature": 0.0, "prompt_tokens": 5, "self_repetition": 0.0,
                       "verified": 4, "accepted": 2, "at": at})  # fmt: skip
