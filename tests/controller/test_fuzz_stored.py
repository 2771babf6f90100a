"""Stored values of every type at every key the controller reads (hypothesis, real Redis; DESIGN contract 7:
stored data never breaks decisions). A hand edit, a bug of another version or another tenant's writes can leave any
Redis type with any contents at any of the schema's names (controller/storage/redis_schema.py): a list where a segment's
bucket hash belongs, a field naming draft position 3,000,000, NaN and Infinity as counters, a score of -inf, a
prior document whose numbers overflow, rows that are not samples.

Each example writes such values over a store that two segments reported to, then:

- a refresh reads it without raising, and the learner is not marked stale (Redis answered: nothing to fall back on);
- Decide, GetSegmentStats, ListSegments, GetCosts and a decision table answer for the victim, for the segment beside
  it and for a segment never seen, with finite figures in range and K within the policy;
- the prior is refitted from the stored samples without raising;
- a report written over the bad keys is taken whole, and both segments learn it: nothing stays poisoned.

In-process over real Redis (the learner, the decisions and the views the gRPC methods answer with), so that a few
hundred examples run in seconds; ``tests/controller/test_stored_data.py`` has the daemon's start-up and a refresh over
gRPC.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from hypothesis import example, given
from hypothesis import strategies as st

from controller.decision.core import Controller
from controller.decision.decide import Request, beta_mean
from controller.decision.learner import Learner
from controller.decision.policy import DRAFTERS, PolicyStore, load_policy
from controller.serving.views import cost_model, segment_stats
from controller.storage.journal import Journal
from controller.storage.redis_conn import make_client
from controller.storage.store import StoreConfig, TelemetryStore
from specd_api.plan import Plan
from tests.controller.test_store import small
from tests.daemons import DEFAULT_POLICY
from tests.fuzzing import fuzz_settings

T0 = 1_700_000_000.0
SEGMENTS = ("victim", "beside")  # both report; the bad values go under the victim's name and the global keys
# ... and the keys the later report writes, set ahead of it: the next bucket's, its dedup markers
KEY_KINDS = ("victim-bucket", "beside-bucket", "new-bucket", "segments", "changes", "change_state", "cost",
             "samples", "prior", "cost-ahead", "victim-ahead", "marker-ahead", "victim-marker-ahead")  # fmt: skip
TYPES = ("string", "hash", "list", "set", "zset")


# --- strategies ------------------------------------------------------------------------------------------------

hostile_numbers = st.sampled_from(
    ["nan", "-nan", "inf", "-inf", "Infinity", "1e308", "-1e308", "1e400", "5e-324", "-0", "0", "1", "-5", "3",
     "1e12", "9007199254740993", "2", "0.5"]
)  # fmt: skip
hostile_text = st.one_of(
    st.text(max_size=12), st.binary(max_size=12), st.sampled_from(["", "x", "{", "[]", "\xff", "a" * 300, "victim"])
)
drafter_names = st.sampled_from([*DRAFTERS, "none", "", "draft ", "élan", "a|b"])
indices = st.sampled_from([-1, 0, 1, 3, 7, 63, 64, 65, 3_000_000, 2**63]) | st.integers(0, 40)


@st.composite
def field_names(draw: st.DrawFn) -> str | bytes:
    """A segment or cost field of the schema with any drafter, index and counter, or anything else."""
    d, i, j = draw(drafter_names), draw(indices), draw(indices)
    kind = draw(st.sampled_from(["k", "p", "q", "cal", "st", "e", "w", "he", "hw", "updated", "other"]))
    counter = draw(st.sampled_from(["rounds", "proposed", "accepted", "tokens", "draft_s", "verify_s", "offered",
                                    "verified", "s", "n", "r", "x"]))  # fmt: skip
    made = {"k": f"k|{d}|{i}|{counter}", "p": f"p|{d}|{i}|{counter}", "q": f"q|{d}|{i}|{counter}",
            "cal": f"cal|{d}|{i}", "st": f"st|{i}|{j}", "e": f"e|{d}|{i}|{counter}", "w": f"w|{i}|{j}|{counter}",
            "he": f"he|{d}|{i}|{j}", "hw": f"hw|{i}|{j}|{j}", "updated": "updated"}  # fmt: skip
    return made.get(kind) or draw(hostile_text) or "f"


json_leaves = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([1e308, -1e308, math.inf, -math.inf, math.nan, 10**400]),
    st.floats(),
    st.text(max_size=6),
)
json_values = st.recursive(
    json_leaves, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3), max_leaves=6
)


# JSON nested past the parser's recursion limit (3,000 brackets raised RecursionError through every reader)
deeply_nested = st.builds(lambda n, o: (o[0] * n + "1" + o[1] * n).encode(), st.integers(900, 5000),
                          st.sampled_from([("[", "]"), ('{"a":', "}")]))  # fmt: skip


@st.composite
def prior_documents(draw: st.DrawFn) -> bytes:
    """A specd.prior.v1 document with some of its values replaced by hostile ones, or any JSON."""
    coef = draw(st.lists(json_leaves, min_size=0, max_size=4) | st.just([0.1, -0.2, 0.3]))
    document: dict[str, Any] = {
        "format": draw(st.sampled_from(["specd.prior.v1", "other"])),
        "features": draw(st.sampled_from([["temperature", "log_prompt_tokens", "self_repetition"], [], "abc"])),
        "trained_unix": draw(json_leaves),
        "tokens": draw(json_leaves),
        "by_drafter": draw(st.dictionaries(drafter_names, st.fixed_dictionaries({"coef": st.just(coef),
                                                                                  "intercept": json_leaves})
                                           | json_values, max_size=3) | json_values),
    }  # fmt: skip
    if draw(st.booleans()):
        document = draw(json_values)
    return draw(deeply_nested) if draw(st.integers(0, 9)) == 0 else json.dumps(document).encode()


@st.composite
def sample_rows(draw: st.DrawFn) -> bytes:
    row = {"drafter": draw(drafter_names), "temperature": draw(json_leaves), "prompt_tokens": draw(json_leaves),
           "self_repetition": draw(json_leaves), "verified": draw(json_leaves), "accepted": draw(json_leaves),
           "at": draw(json_leaves)}  # fmt: skip
    if draw(st.booleans()):
        row = {**row, **draw(st.dictionaries(st.sampled_from(sorted(row)), json_values, max_size=2))}
    return (
        json.dumps(row).encode() if draw(st.booleans()) else draw(hostile_text | st.binary(max_size=20) | deeply_nested)
    )


scores = st.sampled_from([-math.inf, math.inf, 0.0, -1.0, T0, T0 + 1e9, 1e308, -1e308, 2**53 + 1.0]) | st.floats(
    allow_nan=False
)
members = st.sampled_from([*SEGMENTS, "new", "", "a b", "a" * 300, "{victim}", "#global"]) | hostile_text


@st.composite
def stored_values(draw: st.DrawFn, kind: str) -> tuple[str, Any]:
    """(a Redis type, contents of that type) for one key: mostly the type the key should have, hostile inside."""
    expected = {"segments": "zset", "changes": "zset", "samples": "list", "prior": "string"}.get(kind, "hash")
    if kind.endswith("marker-ahead"):  # a string there is what an earlier delivery writes: a duplicate, rightly
        kind_of = draw(st.sampled_from([t for t in TYPES if t != "string"]))
    else:
        kind_of = draw(st.sampled_from([expected, expected, *TYPES]))
    if kind_of == "hash":
        fields = st.sampled_from(["epoch", "seq", "trimmed"]) if kind == "change_state" else field_names()
        values = hostile_numbers | hostile_text
        return kind_of, draw(st.dictionaries(fields, values, min_size=1, max_size=12))
    if kind_of == "zset":
        return kind_of, draw(st.dictionaries(members, scores, min_size=1, max_size=8))
    if kind_of == "list":
        rows = sample_rows() if kind == "samples" else hostile_text | hostile_numbers
        return kind_of, draw(st.lists(rows, min_size=1, max_size=8))
    if kind_of == "set":
        return kind_of, draw(st.sets(hostile_text | hostile_numbers, min_size=1, max_size=5))
    return kind_of, draw(prior_documents() if kind == "prior" else hostile_text | hostile_numbers)


@st.composite
def corruptions(draw: st.DrawFn) -> list[tuple[str, str, Any]]:
    """Up to four of the keys, each overwritten with a value of some type."""
    kinds = draw(st.lists(st.sampled_from(KEY_KINDS), min_size=1, max_size=4, unique=True))
    return [(kind, *draw(stored_values(kind))) for kind in kinds]


# --- the test ----------------------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def client(embedded_redis_url) -> Iterator[redis.Redis]:
    """The embedded server (what a controller starts by default); each example works under a prefix of its own."""
    client = make_client(embedded_redis_url, 2.0)
    yield client
    client.close()


@pytest.fixture(scope="module")
def journal_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz-stored")


@pytest.fixture(scope="module")
def policies() -> PolicyStore:
    return PolicyStore(load_policy(DEFAULT_POLICY))


def key_of(store: TelemetryStore, kind: str, clock: Clock) -> str:
    bucket = store.bucket(clock())
    return {
        "victim-bucket": store.keys.segment_bucket("victim", bucket),
        "beside-bucket": store.keys.segment_bucket("beside", bucket - 1),
        "new-bucket": store.keys.segment_bucket("new", bucket),
        "segments": store.keys.segments(),
        "changes": store.keys.changes(),
        "change_state": store.keys.change_state(),
        "cost": store.keys.cost_bucket(bucket),
        "samples": store.keys.samples(),
        "prior": store.keys.prior(),
        "cost-ahead": store.keys.cost_bucket(bucket + 1),
        "victim-ahead": store.keys.segment_bucket("victim", bucket + 1),
        "marker-ahead": store.keys.report("after"),
        "victim-marker-ahead": store.keys.report("after", "victim"),
    }[kind]


def write(client: redis.Redis, key: str, kind_of: str, value: Any) -> None:
    client.delete(key)
    if kind_of == "hash":
        client.hset(key, mapping=value)
    elif kind_of == "zset":
        client.zadd(key, value)
    elif kind_of == "list":
        client.rpush(key, *value)
    elif kind_of == "set":
        client.sadd(key, *value)
    else:
        client.set(key, value)


def check_plan(plan: Plan, segment: str, policies: PolicyStore) -> None:
    settings = policies.current.for_segment(segment)
    assert plan.drafter == "none" or plan.drafter in DRAFTERS, plan
    k_max = settings.drafter(plan.drafter).k_max if plan.drafter != "none" else 0
    assert 0 <= plan.k <= max(k_max, 0), plan
    assert math.isfinite(plan.expected_speedup) and plan.expected_speedup >= 0, plan
    assert all(math.isfinite(a) and 0 <= a <= 1 for a in (*plan.acceptance, *plan.proposal)), plan
    assert math.isfinite(plan.cost_ratio) and all(math.isfinite(v) for v in plan.verify_cost), plan
    assert math.isfinite(plan.calibration) and not plan.stale, plan


def check_everything_answers(controller: Controller, policies: PolicyStore) -> None:
    learner = controller.learner
    for segment in (*SEGMENTS, "never-seen", *learner.segments()):
        for batch_size in (1, 3, 64):
            for temperature, prompt_tokens, repetition in ((0.0, 10, 0.1), (1.0, 10**6, 1.0)):
                request = Request(segment, batch_size, DRAFTERS, 64, prompt_tokens, temperature, repetition)
                check_plan(controller.decide(request), learner.tracked_segment(segment), policies)
        view = controller.segment_view(segment)
        for estimate in view.estimates.values():  # the posteriors every figure is drawn from: finite, 0 <= mean <= 1
            for successes, failures in (*estimate.conditional, *estimate.proposal):
                assert 0 <= successes < math.inf and 0 <= failures < math.inf, (segment, estimate)
                assert 0 <= beta_mean((successes, failures)) <= 1, (segment, estimate)
            assert math.isfinite(estimate.calibration) and math.isfinite(estimate.cost_ratio), estimate
        stats = segment_stats(view)
        assert stats.ByteSize() < 64 << 10, f"{segment}: {stats.ByteSize()} bytes of statistics"
        for drafter in stats.drafters:
            assert len(drafter.positions) <= 64 and len(drafter.by_k) <= 64, drafter
            numbers = [p.conditional_alpha for p in drafter.positions] + [k.alpha for k in drafter.by_k]
            assert all(math.isfinite(x) for x in [*numbers, *drafter.acceptance, drafter.cost_ratio]), drafter
        plan, probes = controller.table_decisions(Request(segment, 1, DRAFTERS, 64), 16, controller.rng())
        check_plan(plan, learner.tracked_segment(segment), policies)
        assert all(0 < share <= 1 for _, share in probes)
    costs = cost_model(learner.cost_model, learner.stale)
    for bucket in costs.buckets:
        assert math.isfinite(bucket.step_seconds) and bucket.step_seconds >= 0, bucket
        assert all(math.isfinite(v) and v >= 0 for v in bucket.verify_cost), bucket


def make_learner(
    client: redis.Redis, journal_dir: Path, clock: Clock, prefix: str | None = None
) -> tuple[TelemetryStore, Learner, str]:
    """A store and learner as the daemon has them: decay read at the start of each minute's step, so that a refresh
    keeps a segment no change mark names (the marks then decide what a refresh reads)."""
    prefix = prefix or f"f{uuid.uuid4().hex[:12]}"
    store = TelemetryStore(client, StoreConfig(prefix=prefix, decay_step_seconds=60.0), clock)
    journal = Journal(journal_dir / f"{prefix}-{uuid.uuid4().hex[:6]}.jsonl", 100, 2**20)
    return store, Learner(store, journal, clock=clock, prior_retrain_seconds=0.0), prefix


def assert_same_as_a_fresh_read(client: redis.Redis, journal_dir: Path, learner: Learner, clock: Clock) -> None:
    """What the learner holds, read a refresh at a time from what changed, equals what a learner reading everything
    at once finds (a change mark missed keeps a segment's old counts: a reset of unreadable marks that kept the
    epoch would let readers skip the marks after it)."""
    _, fresh, _ = make_learner(client, journal_dir, clock, learner.store.config.prefix)
    assert fresh.refresh() is True
    for segment in {*SEGMENTS, *learner.segments()} - set(learner.drift_watch.regime):
        ours, theirs = learner.segment_counts(segment).rounds, fresh.segment_counts(segment).rounds
        assert ours == pytest.approx(theirs, rel=1e-9, abs=1e-9), (segment, ours, theirs)


def remove(client: redis.Redis, prefix: str) -> None:
    keys = list(client.scan_iter(f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)


@contextmanager
def learner_over(client: redis.Redis, journal_dir: Path) -> Iterator[tuple[TelemetryStore, Learner, Clock]]:
    """A store and learner under a prefix of their own (every key removed afterwards), on a clock the test moves."""
    clock = Clock()
    store, learner, prefix = make_learner(client, journal_dir, clock)
    try:
        yield store, learner, clock
    finally:
        remove(client, prefix)


@given(bad=corruptions())
@example(bad=[("prior", "string", json.dumps({"format": "specd.prior.v1", "tokens": math.inf, "trained_unix": 0,
                                              "features": ["temperature", "log_prompt_tokens", "self_repetition"],
                                              "by_drafter": {}}).encode())])  # fmt: skip
@example(bad=[("victim-bucket", "hash", {"p|draft|3000000|offered": "5", "k|draft|4|rounds": "nan"})])
@example(bad=[("segments", "list", ["victim"])])
@example(bad=[("cost-ahead", "string", "x"), ("samples", "hash", {"a": "1"}), ("change_state", "hash", {"seq": "x"})])
@example(bad=[("victim-ahead", "hash", {"k|draft|2|rounds": "x", "p|draft|0|offered": "inf"})])
@example(bad=[("marker-ahead", "list", ["x"]), ("victim-marker-ahead", "hash", {"a": "1"})])
@example(bad=[("prior", "string", b"[" * 3000), ("samples", "list", [b'{"a":' * 3000])])  # past the recursion limit
@example(bad=[("victim-bucket", "hash", {"p|draft|0|proposed": "1"})])  # proposed, never offered: a rate above 1
@example(
    bad=[("victim-bucket", "hash", {f"p|draft|{i}|{c}": "1e308" for i in (0, 1) for c in ("verified", "accepted")})]
)
@fuzz_settings(250)
def test_any_stored_value_leaves_every_answer_finite_and_learning_resumes(
    client: redis.Redis, journal_dir: Path, policies: PolicyStore, bad: list[tuple[str, str, Any]]
):
    with learner_over(client, journal_dir) as (store, learner, clock):
        controller = Controller(learner, policies)
        store.ingest("before", [small(s, rounds=20, accepted=1) for s in SEGMENTS])
        assert learner.refresh() and set(learner.segments()) == set(SEGMENTS)
        keys = {kind: key_of(store, kind, clock) for kind, _, _ in bad}
        for kind, kind_of, value in bad:
            write(client, keys[kind], kind_of, value)
        clock.now += 1.0
        assert learner.refresh() is True and not learner.stale
        check_everything_answers(controller, policies)
        learner.refit_prior()  # the samples, whatever they are, train a prior or none
        assert learner.refresh() is True
        check_everything_answers(controller, policies)
        # a report in the same bucket and decay step, read from the change marks over whatever they hold
        clock.now += 1.0
        store.ingest("during", [small("beside", rounds=5, accepted=1), small("victim", rounds=5, accepted=1)])
        assert learner.refresh() is True and not learner.stale
        assert_same_as_a_fresh_read(client, journal_dir, learner, clock)

        # A report written over them (in the next bucket: a counter already past any bound stays unreadable in its
        # own) is taken whole, and every segment learns it: nothing stays poisoned, no operator needed.
        clock.now += store.config.bucket_seconds
        after = [small(s, rounds=7, accepted=1) for s in SEGMENTS]
        result = store.ingest("after", after)
        assert not result.duplicate and result.rounds == 14, result
        # the counts (a retry marks its segments changed again: the marks move)
        counted = [k for k in (*keys.values(), store.keys.cost_bucket(store.bucket(clock())))
                   if ":seg:" in k or ":cost:" in k]  # fmt: skip
        written = {k: client.hgetall(k) for k in counted if client.type(k) == "hash"}
        assert store.ingest("after", after).duplicate, "a retry over repaired keys counted twice"
        assert {k: client.hgetall(k) for k in written} == written, "a retry over repaired keys changed them"
        assert learner.refresh() is True and not learner.stale
        for segment in SEGMENTS:
            assert learner.segment_counts(segment).rounds >= 7, (segment, bad)
        assert_same_as_a_fresh_read(client, journal_dir, learner, clock)
        check_everything_answers(controller, policies)
