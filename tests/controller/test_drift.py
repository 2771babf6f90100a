"""The α drift alarm: a Page-Hinkley test on first-position counts per time bucket (controller.decision.drift), and the
controller around it (the learner restarts the segment's regime, GetSegmentStats and `specd segments` show it)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from controller.decision.drift import page_hinkley
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.daemons import running_daemon


def series(rates: list[float], trials: int, seed: int) -> list[tuple[int, float, float]]:
    """One bucket per rate: ``trials`` verified first positions, each accepted with that rate."""
    rng = random.Random(seed)
    return [(b, float(sum(rng.random() < r for _ in range(trials))), float(trials)) for b, r in enumerate(rates)]


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_steady_traffic_raises_no_alarm(rate):
    # 60 buckets of 40 trials each, 20 seeds: binomial noise alone must never look like drift
    for seed in range(20):
        assert page_hinkley(series([rate] * 60, 40, seed)) is None, (rate, seed)


@pytest.mark.parametrize(("before", "after", "direction"), [(0.7, 0.3, "down"), (0.8, 0.55, "down"), (0.2, 0.6, "up")])
def test_a_change_is_found_soon_after_it_began(before, after, direction):
    for seed in range(10):
        drift = page_hinkley(series([before] * 30 + [after] * 30, 40, seed))
        assert drift is not None and drift.direction == direction, seed
        assert 26 <= drift.since_bucket <= 33, drift  # the change began at bucket 30
        assert drift.alpha_before == pytest.approx(before, abs=0.1)
        assert drift.alpha_since == pytest.approx(after, abs=0.15)


def test_empty_buckets_are_skipped_and_nothing_divides_by_zero():
    assert page_hinkley([(0, 0.0, 0.0), (1, 0.0, 0.0)]) is None
    assert page_hinkley([]) is None


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def first_position(segment: str, verified: int, accepted: int) -> pb.RoundsAggregate:
    """``verified`` rounds of the draft model at K = 1, ``accepted`` of them accepted."""
    return pb.RoundsAggregate(
        segment=segment, drafter="draft", k=1, rounds=verified, num_drafted=verified, num_accepted=accepted,
        proposed_per_position=[verified], verified_per_position=[verified], accepted_per_position=[accepted],
        tokens_emitted=verified + accepted, draft_seconds=0.001 * verified, verify_seconds=0.01 * verified,
        batch_size=1, rounds_by_drafted=[0, verified], verify_seconds_by_drafted=[0, 0.01 * verified],
    )  # fmt: skip


def test_the_controller_raises_the_alarm_on_drift_and_not_on_steady_traffic(tmp_path: Path, embedded_redis_url):
    clock = FakeClock()
    learning = {"bucket_seconds": 10, "half_life_seconds": 600, "refresh_seconds": 3600}
    with running_daemon(embedded_redis_url, tmp_path, "{}\n", clock=clock, learning=learning) as daemon:
        import grpc

        stub = pb_grpc.ControllerStub(grpc.insecure_channel(daemon.address))
        rng = random.Random(1)
        reports = 0

        def bucket(segment: str, rate: float) -> None:
            nonlocal reports
            accepted = sum(rng.random() < rate for _ in range(50))
            reports += 1
            stub.ReportRounds(pb.ReportRoundsRequest(report_id=f"r{reports}", aggregates=[
                first_position(segment, 50, accepted)]), timeout=5)  # fmt: skip

        for _ in range(20):  # 20 buckets: both segments steady at 0.8
            bucket("steady", 0.8)
            bucket("drifting", 0.8)
            clock.now += 10
            assert daemon.controller is not None and daemon.controller.learner.refresh()
        for _ in range(10):  # then "drifting" falls to 0.3
            bucket("steady", 0.8)
            bucket("drifting", 0.3)
            clock.now += 10
            daemon.controller.learner.refresh()
        steady = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment="steady"), timeout=5)
        drifting = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment="drifting"), timeout=5)
        assert not steady.drift
        [alarm] = drifting.drift
        assert (alarm.drafter, alarm.direction) == ("draft", "down")
        assert alarm.alpha_before == pytest.approx(0.8, abs=0.05) and alarm.alpha_since < 0.45
        # the regime restarted: the statistics now describe the new traffic only, not a decayed mix
        [first] = next(d for d in drifting.drafters if d.drafter == "draft").positions[:1]
        assert first.conditional_alpha < 0.45
        metrics = daemon.controller.learner.registry.get_sample_value(
            "specd_controller_alpha_drift_alarms_total",
            {"segment": "drifting", "drafter": "draft", "direction": "down"},
        )
        assert metrics == 1


class OnlyLookedUp(dict):
    """Alarms that may be looked up by segment, never walked: a Decide must not pay for other segments' alarms."""

    def items(self):  # type: ignore[override]
        raise AssertionError("every segment's alarms walked for one segment's")

    def __iter__(self):
        raise AssertionError("every segment's alarms walked for one segment's")


def test_a_segments_alarms_are_read_without_walking_every_segments() -> None:
    """Every Decide asks for its segment's alarms: with 2,000 active (1,000 segments, 2 drafters each) sorting them
    all costs 176 us a Decide, 5x the decision's own work. It reads the segment's own, by drafter."""
    from prometheus_client import CollectorRegistry

    from controller.decision.drift_watch import DriftAlarm, DriftWatch

    watch = DriftWatch(CollectorRegistry(), 60.0, 60)
    alarms = OnlyLookedUp()
    for i in range(1000):
        for drafter in ("prompt_lookup", "draft"):  # added out of order: answered by drafter
            alarms.setdefault(f"seg-{i}", {})[drafter] = DriftAlarm(f"seg-{i}", drafter, "down", 0.0, 0.0, 0.6, 0.3)
    watch._alarms = alarms
    assert [(a.segment, a.drafter) for a in watch.alarms("seg-7")] == [("seg-7", "draft"), ("seg-7", "prompt_lookup")]
    assert watch.alarms("never-seen") == []


def test_a_series_found_quiet_is_not_tested_again_until_it_or_its_regime_moves(monkeypatch) -> None:
    """A refresh keeps an untouched segment's series object; the test is pure, so a series it found no drift in, from
    the same regime start, is skipped (at 1,000 segments x 60 buckets the tests were about half of an idle
    controller's CPU). A new series object, or a moved regime start, is tested; drift is still found in it."""
    from prometheus_client import CollectorRegistry

    from controller.decision import drift_watch
    from controller.decision.drift_watch import DriftWatch
    from controller.storage.store import Snapshot

    tested: list[str] = []
    real = drift_watch.page_hinkley

    def counted(points):
        tested.append("x")
        return real(points)

    monkeypatch.setattr(drift_watch, "page_hinkley", counted)
    watch = DriftWatch(CollectorRegistry(), 60.0, 60)
    steady = {f"seg-{i}": {"draft": series([0.6] * 60, 40, i)} for i in range(20)}

    def snapshot(by_segment: dict) -> Snapshot:
        return Snapshot(taken_at=59 * 60.0 + 1, series=by_segment)

    assert not watch.watch(snapshot(steady)) and len(tested) == 20
    assert not watch.watch(snapshot(dict(steady))) and len(tested) == 20, "a quiet series was tested again"
    drifting = dict(steady, **{"seg-3": {"draft": series([0.8] * 30 + [0.3] * 30, 40, 3)}})  # a report moved it
    assert watch.watch(snapshot(drifting)) and len(tested) == 21
    assert [a.direction for a in watch.alarms("seg-3")] == ["down"] and watch.regime["seg-3"] >= 26
    watch.watch(snapshot(drifting))  # seg-3's regime start moved: tested again from there; the others skipped
    assert len(tested) == 22
    watch.regime["seg-5"] = 10  # another regime start: the same series object is tested again
    watch.watch(snapshot(drifting))
    assert len(tested) == 23  # seg-5 alone: seg-3 was found quiet from its new regime's start
