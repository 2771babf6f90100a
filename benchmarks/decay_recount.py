"""A decay step's recount, in-process, side by side: the store's refresh at a decay step (every segment recounted in
one pass over its window: ``SegmentCounts.add_buckets``) against recounting the same windows one bucket at a time
(``add_fields`` and ``first_position`` for each bucket, as a recount without the one-pass sum would), over a full
window of every segment in a real Redis. Prints the CPU seconds of each (median of the runs), the ratio with its
spread, and checks that both count the same.

    python benchmarks/decay_recount.py [--segments 200] [--runs 5] [--redis-url redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.controller_latency import aggregate  # noqa: E402
from controller.decision.counts import SegmentCounts, decay_weight  # noqa: E402
from controller.serving import validation  # noqa: E402
from controller.storage.redis_conn import client_for  # noqa: E402
from controller.storage.redis_schema import first_position  # noqa: E402
from controller.storage.store import RedisClient, Snapshot, StoreConfig, TelemetryStore  # noqa: E402
from specd_api.checks import MAX_AGGREGATES  # noqa: E402
from specd_api.v1 import controller_pb2 as pb  # noqa: E402

BUCKET_S = 60.0


@contextmanager
def window_store(redis_url: str, name: str, segments: int) -> Iterator[tuple[RedisClient, StoreConfig, float]]:
    """A store config under a fresh prefix ``name-...`` in the Redis at ``redis_url``, every bucket of the window of
    ``segments`` segments filled (``filled``): its client, the config and the last bucket's time. Its keys are
    deleted on the way out."""
    client = client_for(redis_url, 10.0)
    config = StoreConfig(prefix=f"{name}-{uuid.uuid4().hex[:8]}", bucket_seconds=BUCKET_S,
                         decay_step_seconds=BUCKET_S, max_segments=max(segments, 1000))  # fmt: skip
    start = math.floor(time.time() / BUCKET_S) * BUCKET_S + 30.0
    try:
        filled(client, config, segments, start)
        yield client, config, start
    finally:
        for key in client.scan_iter(match=f"{config.prefix}:*", count=1000):
            client.delete(key)


def filled(client: object, config: StoreConfig, segments: int, start: float) -> None:
    """Two aggregates of every segment in every bucket of the window, the last bucket's at ``start``."""
    rng = random.Random(0)
    names = [f"seg-{i}" for i in range(segments)]
    for back in range(config.window_buckets - 1, -1, -1):
        at = start - back * BUCKET_S
        store = TelemetryStore(client, config, lambda at=at: at)  # type: ignore[arg-type, misc]
        aggregates = [aggregate(name, rng) for name in names for _ in range(2)]
        for n in range(0, len(aggregates), MAX_AGGREGATES):
            request = pb.ReportRoundsRequest(report_id=f"w{back}-{n}", aggregates=aggregates[n : n + MAX_AGGREGATES])
            store.ingest(*validation.report(request))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segments", type=int, default=200)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    with window_store(args.redis_url, "decay-recount", args.segments) as (client, config, start):
        one_pass, per_bucket = [], []
        for run in range(args.runs):
            clock = [start + 10.0 + run * BUCKET_S]  # each run one decay step later: every weight moves
            store = TelemetryStore(client, config, lambda clock=clock: clock[0])  # type: ignore[misc]
            before = store.read_snapshot(store.active_segments())
            clock[0] += BUCKET_S
            segments = store.active_segments()
            started = time.process_time()
            after = store.read_snapshot(segments, previous=before)
            one_pass.append(time.process_time() - started)
            assert after.current_bucket is not None
            window = range(after.current_bucket - config.window_buckets, after.current_bucket + 1)
            weights = {b: store_weight(config, after, b) for b in window}
            started = time.process_time()
            recounted = recount_one_by_one(after, weights)
            per_bucket.append(time.process_time() - started)
            assert recounted == after.segments, "the one-pass recount counts what the buckets one by one count"
    ratios = sorted(b / a for a, b in zip(one_pass, per_bucket, strict=True))
    result = {"segments": args.segments, "buckets": config.window_buckets, "runs": args.runs,
              "refresh_at_a_step_cpu_s": statistics.median(one_pass),
              "recount_one_by_one_cpu_s": statistics.median(per_bucket),
              "one_by_one_over_one_pass": statistics.median(ratios),
              "ratio_min": ratios[0], "ratio_max": ratios[-1]}  # fmt: skip
    print(f"{args.segments} segments x {config.window_buckets} buckets, {args.runs} decay steps: the refresh "
          f"{result['refresh_at_a_step_cpu_s']:.3f} s of CPU (reads included), the same windows recounted a bucket at "
          f"a time {result['recount_one_by_one_cpu_s']:.3f} s: {result['one_by_one_over_one_pass']:.2f}x "
          f"[{ratios[0]:.2f}, {ratios[-1]:.2f}]")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def store_weight(config: StoreConfig, snapshot: Snapshot, b: int) -> float:
    """The weight the store gives bucket ``b`` at the snapshot's decay step."""
    assert snapshot.decay_at is not None
    return decay_weight(snapshot.decay_at - (b + 1) * config.bucket_seconds, config.half_life_seconds)


def recount_one_by_one(snapshot: Snapshot, weights: dict[int, float]) -> dict[str, SegmentCounts]:
    """Each segment's window recounted a bucket at a time (its counts, and its drift series' entries)."""
    counts = {}
    for segment, (_, regime, made_of) in snapshot.sources.items():
        recount = SegmentCounts()
        for b, fields in made_of:
            if regime is None or b >= regime:
                recount.add_fields(fields, weights[b])
            first_position(fields)
        counts[segment] = recount
    return counts


if __name__ == "__main__":
    raise SystemExit(main())
