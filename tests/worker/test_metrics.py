"""The worker's Prometheus metrics bound their segment label set: client-chosen names cannot grow /metrics."""

from __future__ import annotations

import pytest

from decoder.telemetry import RequestStats
from decoder.worker.metrics import SegmentLabels, WorkerMetrics
from specd_api.rounds import RoundRecord
from specd_api.segments import OVERFLOW_SEGMENT


@pytest.mark.parametrize(
    ("seen", "name", "expected", "why"),
    [
        ([], "a", "a", "room left: a new name keeps its own label"),
        (["a", "b"], "c", OVERFLOW_SEGMENT, "two admitted (the cap): a third is overflow"),
        (["a", "b", "c"], "a", "a", "a name admitted earlier keeps its label after the cap is reached"),
        (["a", "b"], "code", "code", "reserved names (the classifier's, the default) never count against the cap"),
    ],
)
def test_segment_labels(seen: list[str], name: str, expected: str, why: str):
    labels = SegmentLabels(max_segments=2, reserved=("code",))
    for segment in seen:
        labels.label(segment)
    assert labels.label(name) == expected, why


def test_2000_segments_do_not_grow_the_exposition():
    metrics = WorkerMetrics(max_segments=10, reserved=("default",))
    for i in range(10):
        metrics.observe_request(f"s{i}", "finished", None, 0.1)
        metrics.decisions.labels(f"s{i}", "draft", "learned", "controller").inc()
    bounded = len(metrics.exposition())
    for i in range(10, 2000):
        metrics.observe_request(f"s{i}", "finished", None, 0.1)
        metrics.decisions.labels(f"s{i}", "draft", "learned", "controller").inc()
    exposition = metrics.exposition().decode()
    segments = {line.split('segment="')[1].split('"')[0] for line in exposition.splitlines() if 'segment="' in line}
    assert segments == {f"s{i}" for i in range(10)} | {OVERFLOW_SEGMENT}
    # The first 10 kept their series; the other 1,990 share one more set of them (one label value's worth).
    assert len(exposition) < bounded * 1.2, (bounded, len(exposition))
    assert f'specd_requests_total{{segment="{OVERFLOW_SEGMENT}",status="finished"}} 1990.0' in exposition
    assert set(metrics.by_segment) == segments


def test_per_position_series_count_the_accepted_prefix():
    stats = RequestStats(prompt_tokens=4)
    for drafted, accepted in ((3, 1), (3, 3), (0, 0)):
        stats.observe(RoundRecord("draft", 3, drafted, accepted, accepted + 1, 0.0, 0.01))
    metrics = WorkerMetrics()
    metrics.observe_request("s", "finished", stats, 0.1)

    def at(name: str, position: int) -> float | None:
        labels = {"segment": "s", "drafter": "draft", "position": str(position)}
        return metrics.registry.get_sample_value(f"specd_position_{name}_total", labels)

    assert [at("proposed", i) for i in range(4)] == [2.0, 2.0, 2.0, None], "two rounds proposed 3 tokens"
    assert [at("accepted", i) for i in range(3)] == [2.0, 1.0, 1.0], "the first round kept position 0 only"
    assert metrics.registry.get_sample_value("specd_rounds_total", {"segment": "s", "drafter": "draft"}) == 3.0
