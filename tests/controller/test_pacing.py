"""Bulk work on the controller (a report's sums, a refresh's reads, a decay step's table builds) gives the interpreter
to a Decide being served and takes it back when it is done (unpaced, one client's back-to-back reports at the bound
make another client's Decide p99 3.7-7.7x worse, every crossing of a thread waiting for the reporter's next pause)."""

from __future__ import annotations

import threading
import time

from controller.pacing import MAX_YIELD_SECONDS, URGENT, Pacer, Urgency
from specd_api.v1 import controller_pb2 as pb
from tests.controller.test_client import stub_for
from tests.controller.test_decision_tables import daemon_config
from tests.daemons import running


def served_for(urgency: Urgency, seconds: float, started: threading.Event) -> threading.Thread:
    def serve() -> None:
        with urgency.serving():
            started.set()
            time.sleep(seconds)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_pacer_waits_while_a_latency_bound_call_is_served_and_goes_on_when_it_ends() -> None:
    urgency = Urgency()
    pace = Pacer(chunk_seconds=60.0, urgency=urgency)  # no timed pause: only the urgent calls make it wait
    started = threading.Event()
    serving = served_for(urgency, 0.008, started)
    started.wait(5)
    begin = time.perf_counter()
    pace()
    waited = time.perf_counter() - begin
    serving.join(5)
    assert pace.yields == 1 and 0.004 < waited < MAX_YIELD_SECONDS + 0.05, waited
    begin = time.perf_counter()
    pace()
    assert time.perf_counter() - begin < 0.002 and pace.yields == 1, "nothing served: no wait"


def test_a_pacer_never_waits_longer_than_its_bound_under_endless_urgent_calls() -> None:
    urgency = Urgency()
    pace = Pacer(chunk_seconds=60.0, urgency=urgency)
    started = threading.Event()
    serving = served_for(urgency, 0.5, started)
    started.wait(5)
    begin = time.perf_counter()
    for _ in range(3):
        pace()
    assert time.perf_counter() - begin < 3 * MAX_YIELD_SECONDS + 0.1, "bulk work moves on"
    serving.join(5)


def test_a_pacer_on_the_thread_that_serves_never_waits_on_itself() -> None:
    urgency = Urgency()
    pace = Pacer(chunk_seconds=60.0, urgency=urgency)
    with urgency.serving():
        begin = time.perf_counter()
        pace()
        assert time.perf_counter() - begin < 0.002 and pace.yields == 0


def test_decide_over_grpc_is_served_as_urgent(embedded_redis_url, prefix, tmp_path) -> None:
    """The wiring: while the daemon computes a Decide, bulk work on other threads sees it pending."""
    seen: list[bool] = []
    with running(daemon_config(embedded_redis_url, tmp_path, prefix)) as daemon:
        controller = daemon.controller
        assert controller is not None
        original = controller.decide

        def decide(request):  # type: ignore[no-untyped-def]
            other = threading.Thread(target=lambda: seen.append(URGENT.pending))
            other.start()
            other.join(5)
            return original(request)

        controller.decide = decide  # type: ignore[method-assign]
        stub_for(daemon.address).Decide(pb.DecideRequest(segment="s", batch_size=1, prompt_tokens=10), timeout=10)
    assert seen == [True]
    assert not URGENT.pending, "nothing left pending once answered"
