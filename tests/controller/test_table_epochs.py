"""Decision tables at a decay step: a table whose segment had no report follows its counts' decay at its
own decay epoch (every TABLE_DECAY_STEPS steps, each segment at its own phase), not all 1,000 at every step; and a
table recomputed within material_change's tolerances of the one the streams hold is not sent again. The build's
logic with its inputs faked, then a real learner over a real Redis crossing real decay steps."""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis

import controller.serving.table_publisher as table_publisher
from controller.decision.core import Controller
from controller.decision.decide import DrafterEstimate, Request
from controller.decision.learner import Learner
from controller.decision.policy import PolicyStore, parse_policy
from controller.serving.table_publisher import TABLE_DECAY_STEPS, DecisionPublisher, TableKey, _differs
from controller.storage.journal import Journal
from specd_api.v1 import controller_pb2 as pb
from tests.controller.test_store import T0, FakeClock, make_store, small

DRAFTERS = ("draft",)


@dataclass
class Inputs:
    """What the faked key functions and table read for the one segment "s"."""

    hard: int = 0
    soft: int = 0
    epoch: int = 0
    acceptance: float = 0.70


def faked(monkeypatch: pytest.MonkeyPatch, inputs: Inputs) -> tuple[DecisionPublisher, list[str]]:
    computed: list[str] = []

    def segment_table(controller: object, segment: str, drafters: object, **_: object) -> pb.SegmentTable:
        computed.append(segment)
        t = pb.SegmentTable(segment=segment, max_batch_size=8, min_new_tokens=5)
        t.buckets.add(batch_bucket=1, plan=pb.Decision(drafter="draft", k=4, acceptance=[inputs.acceptance]))
        return t

    monkeypatch.setattr(table_publisher, "segment_table", segment_table)
    monkeypatch.setattr(table_publisher, "table_key", lambda c, s, d: TableKey((s, inputs.hard), (inputs.soft,)))
    monkeypatch.setattr(table_publisher, "quick_key", lambda c, s, d: (s, inputs.hard, inputs.soft, inputs.epoch))
    monkeypatch.setattr(table_publisher, "decay_epoch", lambda c, s: inputs.epoch)
    learner = SimpleNamespace(segments=lambda: ["s"], stale=False)
    controller = SimpleNamespace(learner=learner, policies=SimpleNamespace(current=SimpleNamespace(version="p1")))
    return DecisionPublisher(controller, 1.0, 4), computed  # type: ignore[arg-type]


def test_a_soft_move_waits_for_the_segments_epoch_a_hard_one_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = Inputs()
    publisher, computed = faked(monkeypatch, inputs)
    first = publisher._build(DRAFTERS, {})
    assert computed == ["s"]
    inputs.soft += 1  # a decay step, or a prior refit
    kept = publisher._build(DRAFTERS, first)
    assert computed == ["s"] and kept["s"].data is first["s"].data, "within its epoch: kept, not recomputed"
    inputs.epoch += 1
    publisher._build(DRAFTERS, kept)
    assert computed == ["s", "s"], "its epoch turned: recomputed"
    inputs.hard += 1  # a report on the segment
    publisher._build(DRAFTERS, kept)
    assert computed == ["s", "s", "s"], "a hard move: recomputed at once"


def test_a_recomputed_table_within_the_tolerances_is_not_sent_and_moves_add_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    inputs = Inputs(acceptance=0.700)
    publisher, computed = faked(monkeypatch, inputs)
    held = publisher._build(DRAFTERS, {})
    inputs.epoch, inputs.soft, inputs.acceptance = 1, 1, 0.706
    second = publisher._build(DRAFTERS, held)
    assert len(computed) == 2 and not _differs(held["s"], second["s"]), "0.006 apart: the streams' table stays"
    assert second["s"].table.buckets[0].plan.acceptance[0] == pytest.approx(0.700)
    assert publisher.stats.tables_within_tolerance == 1
    inputs.epoch, inputs.soft, inputs.acceptance = 2, 2, 0.712
    third = publisher._build(DRAFTERS, second)
    assert _differs(second["s"], third["s"]), "0.012 from what the streams hold (0.006 from the last computed): sent"
    assert third["s"].table.buckets[0].plan.acceptance[0] == pytest.approx(0.712)


# --- a real learner over a real Redis -------------------------------------------------------------------------------

BUCKET = 10.0
SEGMENTS = [f"epoch-{i:02d}" for i in range(24)]


def real(redis_client: redis.Redis, prefix: str, window: int = 60) -> tuple[FakeClock, Learner, Controller]:
    clock = FakeClock(T0 + 1)
    store = make_store(
        redis_client, prefix, clock, bucket_seconds=BUCKET, decay_step_seconds=BUCKET, window_buckets=window
    )
    journal = Journal(Path(tempfile.mkdtemp()) / "journal.jsonl", 1000)
    learner = Learner(store, journal, clock, prior_retrain_seconds=1e9)
    return clock, learner, Controller(learner, PolicyStore(parse_policy("{}")))


def counting_tables(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The segments whose table is computed from now on, in order."""
    computed: list[str] = []
    segment_table = table_publisher.segment_table

    def counted(c: Any, segment: str, drafters: Any, **options: Any) -> Any:
        computed.append(segment)
        return segment_table(c, segment, drafters, **options)

    monkeypatch.setattr(table_publisher, "segment_table", counted)
    return computed


def teach(learner: Learner, segments: list[str], report_id: str, accepted: int = 3) -> None:
    learner.report(report_id, [small(s, k=4, rounds=60, accepted=accepted) for s in segments])


def test_a_decay_step_moves_a_segments_counts_but_not_its_data_version(redis_client: redis.Redis, prefix: str) -> None:
    clock, learner, _ = real(redis_client, prefix)
    teach(learner, ["a", "b"], "r1")
    learner.refresh()
    versions = {s: (learner.segment_version(s), learner.data_version(s)) for s in ("a", "b")}
    steps = learner.decay_steps
    clock.now += BUCKET  # a decay step, no report
    learner.refresh()
    assert learner.decay_steps == steps + 1
    for s in ("a", "b"):
        assert learner.segment_version(s) > versions[s][0], "the counts moved (decayed)"
        assert learner.data_version(s) == versions[s][1], "what they are made of did not"
    teach(learner, ["a"], "r2")
    learner.refresh()
    assert learner.data_version("a") > versions["a"][1] and learner.data_version("b") == versions["b"][1]
    clock.now += 3 * BUCKET  # three decay steps before the next refresh (Redis was away, say): each epoch moves on
    learner.refresh()
    assert learner.decay_steps == steps + 4
    b_data = learner.data_version("b")
    teach(learner, ["b"], "r3")
    clock.now += BUCKET  # a report and a decay step, one refresh: the report is what counts
    learner.refresh()
    assert learner.data_version("b") > b_data


def test_a_bucket_leaving_a_full_window_at_a_decay_step_is_ageing_not_new_data(
    redis_client: redis.Redis, prefix: str
) -> None:
    """With every bucket of the window filled, every segment loses its oldest bucket at every decay step: that is
    ageing, like the decay (its table follows at its epoch), or all 1,000 tables would be recomputed at every step.
    A segment that loses its last bucket, gains one, or has a report in one it keeps, has new data."""
    clock, learner, _ = real(redis_client, prefix, window=3)
    for n in range(3):  # "full" in each bucket of the window; "once" in its first only
        teach(learner, ["full", *(["once"] if n == 0 else [])], f"fill-{n}")
        learner.refresh()
        clock.now += BUCKET
    clock.now -= BUCKET
    learner.refresh()
    data = {s: learner.data_version(s) for s in ("full", "once")}
    counts = learner.segment_counts("full")
    clock.now += BUCKET  # a decay step: the first bucket leaves the window, "once"'s only one with it
    learner.refresh()
    assert learner.segment_counts("full") is not counts, "its counts moved: a bucket less, and decayed"
    assert learner.data_version("full") == data["full"], "ageing: the oldest bucket left, nothing came"
    assert learner.data_version("once") > data["once"], "its last bucket left: it has no counts now"
    teach(learner, ["full"], "after")
    clock.now += BUCKET  # a step and a report in one refresh: the report is new data
    learner.refresh()
    assert learner.data_version("full") > data["full"]
    teach(learner, ["full"], "into-the-current")
    learner.refresh()
    version = learner.data_version("full")
    teach(learner, ["full"], "into-a-kept-bucket")  # the same bucket: one the window keeps past the next step
    clock.now += BUCKET
    learner.refresh()
    assert learner.data_version("full") > version, "a report into a bucket the window keeps is new data"


def test_a_tables_buckets_sample_the_posteriors_once_per_decision(
    redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table's batch buckets share its decisions' posterior draws (``SharedDraws``): a drafter's posterior is
    sampled at most once per decision, not once per decision and bucket (the draws were most of a table's build)."""
    _, learner, _ = real(redis_client, prefix)
    policy = "defaults: {exploration_rate: 0.5, min_exploration_rate: 0.3}"
    controller = Controller(learner, PolicyStore(parse_policy(policy)))
    teach(learner, ["probed"], "r1", accepted=0)  # a draft that never lands: off, and probed
    learner.refresh()
    sampled: list[str] = []
    sample = DrafterEstimate.sample
    monkeypatch.setattr(DrafterEstimate, "sample", lambda self, rng: sampled.append(self.drafter) or sample(self, rng))
    drafters = ("draft", "prompt_lookup")
    table = table_publisher.segment_table(controller, "probed", drafters)
    assert table is not None and len(table.buckets) >= 4 and any(b.probes for b in table.buckets)
    assert 0 < len(sampled) <= table_publisher.PROBE_DRAWS * len(drafters), len(sampled)


def test_a_refresh_build_gives_the_interpreter_back_between_a_tables_draws(
    redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A table's draws are 5-15 ms of the interpreter: a build calls its pacer between them, not only between
    tables, or a Decide waits for the switch interval at each of its thread crossings for a whole table. A stream's
    first build too (a client's streams of new drafter sets would hold every Decide over their builds)."""
    _, learner, _ = real(redis_client, prefix)
    policy = "defaults: {exploration_rate: 0.5, min_exploration_rate: 0.3}"
    controller = Controller(learner, PolicyStore(parse_policy(policy)))
    teach(learner, ["probed"], "r1", accepted=0)
    learner.refresh()
    calls = [0]

    class Counting(table_publisher.Pacer):
        def __call__(self) -> None:
            calls[0] += 1
            super().__call__()

    monkeypatch.setattr(table_publisher, "Pacer", Counting)
    publisher = DecisionPublisher(controller, 1.0, 4)
    first = publisher._build(("draft", "prompt_lookup"), {})
    probed = first["probed"].table
    assert calls[0] >= table_publisher.PROBE_DRAWS * len(probed.buckets), ("the first build: between draws", calls[0])
    teach(learner, ["probed"], "r2", accepted=0)  # a report: its table is recomputed at the next refresh
    learner.refresh()
    calls[0] = 0
    table = publisher._build(("draft", "prompt_lookup"), first)["probed"].table
    assert len(table.buckets) >= 4 and any(b.probes for b in table.buckets)
    assert calls[0] >= table_publisher.PROBE_DRAWS * len(table.buckets), calls[0]


def test_decay_steps_recompute_a_share_of_the_tables_each_and_every_table_within_the_epoch(
    redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decay step recomputes a share of the tables, not every one (1-2 s of CPU at 1,000 segments, ~70 % of them
    sent)."""
    clock, learner, controller = real(redis_client, prefix)
    teach(learner, SEGMENTS, "r1")
    learner.refresh()
    publisher = DecisionPublisher(controller, 1.0, 4, clock)
    built = publisher._build(DRAFTERS, {})
    assert sorted(built) == SEGMENTS, "every segment is past the prior's weight: every one has a table"
    computed = counting_tables(monkeypatch)
    per_step = []
    for _ in range(TABLE_DECAY_STEPS):
        clock.now += BUCKET
        learner.refresh()
        before = len(computed)
        built = publisher._build(DRAFTERS, built)
        per_step.append(len(computed) - before)
    assert sorted(computed) == SEGMENTS, f"each table once within {TABLE_DECAY_STEPS} steps: {sorted(computed)}"
    assert max(per_step) <= len(SEGMENTS) * 0.6, f"tables recomputed per step: {per_step}"
    computed.clear()
    teach(learner, [SEGMENTS[0]], "r2", accepted=0)  # mid-epoch, a report that moves its acceptance
    learner.refresh()
    before = built[SEGMENTS[0]]
    built = publisher._build(DRAFTERS, built)
    assert computed == [SEGMENTS[0]], "a report's segment: recomputed at once, and only it"
    assert _differs(before, built[SEGMENTS[0]]), "and sent"


def test_the_tables_a_decay_step_moves_are_recomputed_spread_over_the_refreshes_of_the_steps_periods(
    redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each segment's epoch turns at its own point within TABLE_DECAY_STEPS steps' periods, not at a step: with 8
    refreshes a step, the tables decay moved are recomputed a few at a refresh, each once within the epoch, rather
    than a quarter of them at the refresh that reads the step (a burst of seconds of CPU at 1,000 segments)."""
    clock, learner, controller = real(redis_client, prefix)
    teach(learner, SEGMENTS, "r1")
    learner.refresh()
    publisher = DecisionPublisher(controller, 1.0, 4, clock)
    built = publisher._build(DRAFTERS, {})
    computed = counting_tables(monkeypatch)
    per_refresh = []
    for _ in range((TABLE_DECAY_STEPS + 1) * 8):  # the first step's period moves nothing: no decay step yet
        clock.now += BUCKET / 8
        learner.refresh()
        before = len(computed)
        built = publisher._build(DRAFTERS, built)
        per_refresh.append(len(computed) - before)
    once = Counter(computed)
    assert sorted(once) == SEGMENTS and set(once.values()) == {1}, f"each table once within the epoch: {once}"
    # 24 tables over 32 refreshes: at most 2 a refresh for these names; phases in whole steps would give 5-7 at a step
    assert max(per_refresh) <= 3 and sum(1 for n in per_refresh if n) >= 12, f"tables a refresh: {per_refresh}"


def test_two_drafter_sets_tables_hold_a_hysteresis_memory_each_and_recompute_nothing_when_nothing_moved(
    redis_client: redis.Redis, prefix: str
) -> None:
    """A plan is remembered under its segment and the drafters it was chosen among: the tables of workers that offer
    the draft model and of workers that offer prompt lookup alone do not move each other's memory (shared, each
    build would move the other's keys, and every table of both would be recomputed at every refresh)."""
    clock, learner, controller = real(redis_client, prefix)
    teach(learner, SEGMENTS, "r1")
    learner.refresh()
    publisher = DecisionPublisher(controller, 1.0, 8, clock)
    sets = [("draft",), ("prompt_lookup",)]
    built = {d: publisher._build(d, {}) for d in sets}
    assert all(sorted(built[d]) == SEGMENTS for d in sets)
    plans = {d: built[d][SEGMENTS[0]].table.buckets[0].plan.drafter for d in sets}
    assert plans[("draft",)] == "draft" and plans[("prompt_lookup",)] != "draft", plans  # lookup: off, taught none
    for d in sets:
        remembered = controller.previous_plan(SEGMENTS[0], d)
        assert remembered is not None and remembered.drafter == plans[d]
    # a Decide's drafters in a worker's order, "none" among them: the memory of the set, whatever the order
    both = Request(SEGMENTS[-1], 1, ("prompt_lookup", "none", "draft"), 128)
    for _ in range(200):  # a probe is not remembered
        controller.decide(both)
        if controller.previous_plan(SEGMENTS[-1], ("draft", "prompt_lookup")) is not None:
            break
    assert controller.previous_plan(SEGMENTS[-1], ("draft", "prompt_lookup")) is not None
    computed = publisher.stats.tables_built
    for _ in range(3):
        clock.now += 0.5  # refreshes within one decay step's period, no report
        learner.refresh()
        built = {d: publisher._build(d, built[d]) for d in sets}
    assert publisher.stats.tables_built == computed, "nothing moved: no table recomputed"


def test_tables_recomputed_within_the_tolerances_are_not_recomputed_again_at_the_next_refresh(
    redis_client: redis.Redis, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refresh whose recomputed tables are all within the tolerances (nothing to send) keeps them under their new
    keys: dropped, every later refresh would recompute the same quarter of the tables again (25 % of a core, 1,000
    segments, for the rest of the epoch)."""
    clock, learner, controller = real(redis_client, prefix)
    teach(learner, SEGMENTS, "r1")
    learner.refresh()
    publisher = DecisionPublisher(controller, 1.0, 4, clock)
    stream = publisher.watch(DRAFTERS, lambda: True)
    try:
        assert len(next(stream).segments) == len(SEGMENTS)
        publisher.rebuild()
        computed = counting_tables(monkeypatch)
        clock.now += BUCKET  # a decay step: a share of the tables recomputed, each within the tolerances
        learner.refresh()
        publisher.rebuild()
        assert computed and publisher.stats.tables_within_tolerance == len(computed)
        computed.clear()
        learner.refresh()
        publisher.rebuild()
        publisher.rebuild()
        assert computed == [], f"{len(computed)} tables recomputed again with nothing moved"
    finally:
        publisher.close()


def test_the_pacing_benchmark_runs_every_mode_side_by_side(tmp_path: Path) -> None:
    from benchmarks.build_pacing import MODES, main

    out = tmp_path / "pacing.json"
    assert main(["--segments", "3", "--runs", "1", "--seconds", "0.3", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["segments"] == 3 and all(result[f"{m}_p99_ms"] > 0 for m in MODES)
    assert result["tables_over_draws_min"] <= result["p99_between_tables_over_between_draws"]
