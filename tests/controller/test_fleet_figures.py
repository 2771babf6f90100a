"""The fleet's figures (each drafter's acceptance and calibration over every segment, decision/learner.py) are
computed when the learner's version moves, by whatever moved it, never by a Decide: at 1,000 segments they take 7 ms,
which the first Decide after each refresh would otherwise pay on the event loop. A real daemon over gRPC."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import controller.decision.learner as learner_module
from controller.decision.decide import Request
from controller.decision.learner import fleet_acceptance, fleet_calibration
from controller.server import ControllerDaemon
from specd_api.modes import GREEDY, MODES, SAMPLED
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
    for mode in MODES:
        tables = learner._fleet_tables(mode)
        for drafter in DRAFTERS:  # what was computed ahead is what the tables hold now
            assert learner.fleet_acceptance(drafter, mode) == fleet_acceptance(tables, drafter)
            assert learner.fleet_calibration(drafter, mode) == fleet_calibration(tables, drafter)
    assert learner.fleet_acceptance("draft")[1] > 0


def test_each_sampling_modes_fleet_figures_are_its_own(daemon) -> None:
    """A sampled draft token is accepted with min(1, p/q), a greedy one only when it is the target's argmax: a new
    segment's prior acceptance is the fleet's of its own sampling mode, so that sampled traffic starts from what
    sampled rounds accepted, not from what greedy ones did (which promised it their speedup)."""
    learner = daemon.controller.learner
    rarely = dict(verified_per_position=[10, 1], accepted_per_position=[1, 0], num_accepted=1, tokens_emitted=11)
    with connected(daemon) as channel:
        stub = pb_grpc.ControllerStub(channel)
        before = learner.version
        greedy, sampled = draft_aggregate("modes-greedy"), draft_aggregate("modes-sampled", temperature=1.2, **rarely)
        stub.ReportRounds(report(greedy, sampled), timeout=10)
        deadline = time.monotonic() + 10
        while not (learner.counted("modes-sampled#sampled") and learner.version > before):
            assert time.monotonic() < deadline, "the report never reached the learner"
            time.sleep(0.05)
    accepted, verified = learner.fleet_acceptance("draft", SAMPLED)
    assert (accepted, verified) == (1.0, 11.0), "the sampled fleet holds the sampled segment's positions alone"
    accepted, verified = learner.fleet_acceptance("draft", GREEDY)
    assert accepted / verified >= 12 / 18, "the greedy fleet holds none of the sampled segment's rounds"
    assert learner.prior is None, "a trained prior would predict α instead of the fleet's"
    controller = daemon.controller
    settings = controller.policies.current.for_segment("modes-new")
    inputs = {}
    for name in ("modes-new", "modes-new#sampled"):
        request = Request.neutral(name, 1, DRAFTERS, 64)
        inputs[name] = {d: alpha for d, alpha, _, _ in controller.estimate_inputs(settings, request)}
    strength, prior_alpha = settings.prior_strength, settings.drafter("draft").prior_alpha
    assert inputs["modes-new#sampled"]["draft"] == round((1.0 + strength * prior_alpha) / (11.0 + strength), 3)
    assert inputs["modes-new#sampled"]["draft"] < inputs["modes-new"]["draft"]
