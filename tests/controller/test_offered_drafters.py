"""A segment's view (GetSegmentStats, /metrics, the demo's table) decides among the drafters workers offer: a head's
drafter (eagle) only once a worker has offered it, over a real learner on a real Redis."""

from __future__ import annotations

import redis

from controller.decision.decide import Request
from tests.controller.test_table_epochs import real


def test_a_segment_view_shows_only_drafters_some_worker_offered(redis_client: redis.Redis):
    _, _, controller = real(redis_client, "offered")
    view = controller.segment_view("code")
    assert "eagle" not in view.arms and view.decision.drafter != "eagle"
    assert {"draft", "prompt_lookup", "chain", "suffix"} <= set(view.arms)

    controller.decide(Request.neutral("code", 1, ("prompt_lookup", "eagle"), 128))
    offered = controller.segment_view("code")
    assert set(offered.arms) == {"prompt_lookup", "eagle"}, offered.arms
