"""The fleet's figures (each drafter's acceptance and calibration over every segment, decision/learner.py) are
computed when the learner's version moves, by whatever moved it, never by a Decide: at 1,000 segments they take 7 ms,
which the first Decide after each refresh paid on the event loop (issue 22). A real daemon over gRPC."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import controller.decision.learner as learner_module
from controller.decision.learner import fleet_acceptance, fleet_calibration
from controller.server import ControllerDaemon
from specd_api.plan import DRAFTERS
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.controller.test_service import decide, draft_aggregate, report
from tests.daemons import connected, running_daemon


@pytest.fixture(scope="module")
def daemon(embedded_redis_url, tmp_path_factory) -> Iterator[ControllerDaemon]:
    with running_daemon(embedded_redis_url, tmp_path_factory.mktemp("fleet")) as d:
        yield d


def test_a_decide_after_the_learner_moved_never_computes_the_fleets_figures(daemon, monkeypatch) -> None:
    learner = daemon.controller.learner
    computed: list[str] = []  # the threads that computed a figure
    for name, compute in list(learner_module.FLEET_FIGURES.items()):

        def spy(tables: Any, drafter: str, _compute: Any = compute) -> tuple[float, float]:
            computed.append(threading.current_thread().name)
            return _compute(tables, drafter)

        monkeypatch.setitem(learner_module.FLEET_FIGURES, name, spy)
    with connected(daemon) as channel:
        stub = pb_grpc.ControllerStub(channel)
        before = learner.version
        stub.ReportRounds(report(draft_aggregate("fleet-a"), draft_aggregate("fleet-b")), timeout=10)
        deadline = time.monotonic() + 10
        while not (learner.counted("fleet-a") and learner.version > before):
            assert time.monotonic() < deadline, "the report never reached the learner"
            time.sleep(0.05)
        assert len(computed) >= 2 * len(DRAFTERS), "the move computed no figures ahead"
        computed.clear()
        for segment in ("fleet-a", "fleet-b", "fleet-new"):
            decide(stub, segment)
    assert "specd-grpc-loop" not in computed, "a Decide computed the fleet's figures on the event loop"
    tables = learner._fleet_tables()
    for drafter in DRAFTERS:  # what was computed ahead is what the tables hold now
        assert learner.fleet_acceptance(drafter) == fleet_acceptance(tables, drafter)
        assert learner.fleet_calibration(drafter) == fleet_calibration(tables, drafter)
    assert learner.fleet_acceptance("draft")[1] > 0
