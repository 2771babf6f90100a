"""A client naming a new segment in every Decide (a segment flood): each such segment decides from the priors alone, so
they all share one cache entry and none of them is remembered for hysteresis. Otherwise each made-up name would cost
6.5x a learned segment's Decide (its posteriors computed afresh) and, past the caches' size, push the learned segments'
estimates and last plans out: another client's segment would lose its hysteresis. A real daemon over gRPC."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from controller.decision.decide import Request
from controller.server import ControllerDaemon
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.controller.test_service import decide, draft_aggregate, report
from tests.daemons import connected, running_daemon

MAX_SEGMENTS = 20  # the daemon's caches keep 2 x this many segments' entries, its plans as many a drafter set
DRAFTERS = ("draft", "prompt_lookup")  # what test_service's decide offers
LEARNED = "learned-segment"


@pytest.fixture(scope="module")
def daemon(embedded_redis_url, tmp_path_factory) -> Iterator[ControllerDaemon]:
    with running_daemon(
        embedded_redis_url, tmp_path_factory.mktemp("made-up"), learning={"max_segments": MAX_SEGMENTS},
        max_drafter_sets=1,
    ) as d:  # fmt: skip
        yield d


@pytest.fixture(scope="module")
def stub(daemon) -> Iterator[pb_grpc.ControllerStub]:
    with connected(daemon) as channel:
        yield pb_grpc.ControllerStub(channel)


def learned(daemon: ControllerDaemon, stub: pb_grpc.ControllerStub) -> None:
    """LEARNED counted, and its last plan remembered (Decide until one is: a probe is not remembered)."""
    stub.ReportRounds(report(draft_aggregate(LEARNED)), timeout=10)
    deadline = time.monotonic() + 10
    while not daemon.controller.learner.counted(LEARNED):
        assert time.monotonic() < deadline, "the report never reached the learner"
        time.sleep(0.05)
    for _ in range(200):
        decide(stub, LEARNED)
        if daemon.controller.previous_plan(LEARNED, DRAFTERS) is not None:
            return
    raise AssertionError("200 Decides and no plan remembered for the learned segment")


def test_made_up_segments_do_not_push_a_learned_segments_plan_out(daemon, stub) -> None:
    learned(daemon, stub)
    kept = daemon.controller.previous_plan(LEARNED, DRAFTERS)
    for _ in range(4 * MAX_SEGMENTS):  # twice what the memory holds
        decision = decide(stub, f"made-up-{uuid.uuid4().hex}")
        assert decision.drafter  # answered, from the priors
    assert daemon.controller.previous_plan(LEARNED, DRAFTERS) == kept


def test_segments_without_counts_share_their_estimates(daemon, stub) -> None:
    controller = daemon.controller
    settings = controller.policies.current.for_segment("made-up-a")
    costs = controller.learner.cost_model.at(1)

    def estimates(segment: str) -> object:
        return controller.estimates(settings, Request(segment, 1, ("draft", "prompt_lookup"), 64), costs)

    first = estimates(f"made-up-{uuid.uuid4().hex}")
    assert estimates(f"made-up-{uuid.uuid4().hex}") is first  # one entry, not one per name
    learned(daemon, stub)
    assert estimates(LEARNED) is not first  # a counted segment has its own


def test_a_made_up_segment_is_not_remembered(daemon, stub) -> None:
    name = f"made-up-{uuid.uuid4().hex}"
    for _ in range(20):
        decide(stub, name)
    assert daemon.controller.previous_plan(name, DRAFTERS) is None
