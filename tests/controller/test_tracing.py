"""Tracing: every RPC is a SERVER span that continues the caller's trace (W3C context in gRPC metadata),
carries the decision as attributes, and is marked ERROR when the request is refused.

The servicer runs in a real grpc.server on a loopback port; its spans go to an in-memory exporter through a
SimpleSpanProcessor (synchronous, so a span is exported by the time its RPC has answered).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from controller.decision.core import Controller
from controller.decision.learner import Learner
from controller.decision.policy import PolicyStore, load_policy
from controller.service import ControllerServicer
from controller.storage.journal import Journal
from controller.storage.redis_conn import make_client
from controller.storage.store import StoreConfig, TelemetryStore
from specd_api.tracing import metadata_with_context
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc

DEFAULT_POLICY = Path(__file__).resolve().parents[2] / "policies" / "default.yaml"
DECIDE_SPAN = "specd.v1.Controller/Decide"
DECISION_ATTRIBUTES = (
    "specd.segment",
    "specd.drafter",
    "specd.k",
    "specd.decision.reason",
    "specd.policy_version",
    "specd.expected_speedup",
    "specd.exploration",
)


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def controller(embedded_redis_url, tmp_path_factory) -> Iterator[Controller]:
    """The controller as server.py assembles it: policy, telemetry store on the embedded Redis, learner."""
    prefix = f"t{uuid.uuid4().hex[:12]}"
    client = make_client(embedded_redis_url, 2.0)
    store = TelemetryStore(client, StoreConfig(prefix=prefix), time.time)
    learner = Learner(store, Journal(tmp_path_factory.mktemp("journal") / "journal.jsonl", 100))
    learner.refresh()
    yield Controller(learner, PolicyStore(load_policy(DEFAULT_POLICY)))
    keys = list(client.scan_iter(f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture(scope="module")
def stub(controller, exporter) -> Iterator[pb_grpc.ControllerStub]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_ControllerServicer_to_server(ControllerServicer(controller, provider.get_tracer("specd.test")), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield pb_grpc.ControllerStub(channel)
    server.stop(None).wait()
    provider.shutdown()


@pytest.fixture
def spans(exporter) -> InMemorySpanExporter:
    """The exporter, emptied of earlier tests' spans."""
    exporter.clear()
    return exporter


@pytest.fixture(scope="module")
def worker_tracer():
    """The caller's side: a provider of its own, as a decode worker in another process would have."""
    provider = TracerProvider()
    yield provider.get_tracer("specd.worker")
    provider.shutdown()


def finished(exporter: InMemorySpanExporter, name: str) -> ReadableSpan:
    """The one finished span called ``name`` (waiting briefly: the server ends it as it answers)."""
    deadline = time.monotonic() + 2.0
    while True:
        found = [s for s in exporter.get_finished_spans() if s.name == name]
        if found or time.monotonic() > deadline:
            assert len(found) == 1, [s.name for s in exporter.get_finished_spans()]
            return found[0]
        time.sleep(0.01)


def decide_request(segment: str = "chat", batch_size: int = 1) -> pb.DecideRequest:
    return pb.DecideRequest(
        segment=segment, batch_size=batch_size, drafters=["draft", "prompt_lookup"], max_new_tokens=64
    )


def test_decide_span_continues_the_callers_trace(stub, spans, worker_tracer):
    with worker_tracer.start_as_current_span("worker.request") as client_span:
        stub.Decide(decide_request(), metadata=metadata_with_context(), timeout=5)
    caller = client_span.get_span_context()

    span = finished(spans, DECIDE_SPAN)
    assert span.context.trace_id == caller.trace_id
    assert span.parent is not None
    assert span.parent.span_id == caller.span_id
    assert span.parent.is_remote  # it came over the wire, not from the server's own context
    assert span.kind == SpanKind.SERVER
    assert span.status.status_code != StatusCode.ERROR


def test_decide_span_carries_the_decision(stub, spans, worker_tracer):
    with worker_tracer.start_as_current_span("worker.request"):
        decision = stub.Decide(decide_request(), metadata=metadata_with_context(), timeout=5)

    attributes = finished(spans, DECIDE_SPAN).attributes
    assert attributes is not None
    assert set(DECISION_ATTRIBUTES) <= set(attributes)
    # The span says what the caller was told, field by field.
    assert attributes["specd.segment"] == decision.segment == "chat"
    assert attributes["specd.drafter"] == decision.drafter
    assert attributes["specd.k"] == decision.k
    assert attributes["specd.decision.reason"] == decision.reason
    assert attributes["specd.policy_version"] == decision.policy_version
    assert attributes["specd.expected_speedup"] == pytest.approx(decision.expected_speedup)
    assert attributes["specd.exploration"] == decision.exploration


def test_rule_decision_attributes(stub, spans):
    # Batch 9 is above the default threshold of 8: the reason on the span is the rule's.
    stub.Decide(decide_request(batch_size=9), timeout=5)
    attributes = finished(spans, DECIDE_SPAN).attributes
    assert attributes is not None
    assert (attributes["specd.drafter"], attributes["specd.decision.reason"]) == ("none", "batch_size_above_threshold")
    assert attributes["specd.k"] == 0


def test_without_caller_context_the_span_starts_a_trace(stub, spans):
    stub.Decide(decide_request(), timeout=5)
    span = finished(spans, DECIDE_SPAN)
    assert span.parent is None
    assert span.kind == SpanKind.SERVER


@pytest.mark.parametrize(
    ("rpc", "request_message", "span_name"),
    [
        # an empty segment is refused before any decision is made
        pytest.param("Decide", decide_request(segment=""), DECIDE_SPAN, id="decide"),
        # a report without its idempotency key is refused before anything is stored
        pytest.param(
            "ReportRounds", pb.ReportRoundsRequest(report_id=""), "specd.v1.Controller/ReportRounds", id="report"
        ),
        # a segment with a space cannot be a Redis key part
        pytest.param(
            "GetSegmentStats",
            pb.GetSegmentStatsRequest(segment="a b"),
            "specd.v1.Controller/GetSegmentStats",
            id="stats",
        ),
    ],
)
def test_refused_request_span_is_an_error_in_the_callers_trace(
    stub, spans, worker_tracer, rpc, request_message, span_name
):
    with worker_tracer.start_as_current_span("worker.request") as client_span, pytest.raises(grpc.RpcError) as error:
        getattr(stub, rpc)(request_message, metadata=metadata_with_context(), timeout=5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    span = finished(spans, span_name)
    assert span.status.status_code == StatusCode.ERROR
    assert span.status.description  # says why
    assert span.kind == SpanKind.SERVER
    assert span.context.trace_id == client_span.get_span_context().trace_id


def test_every_rpc_is_a_server_span(stub, spans):
    stub.GetPolicy(pb.GetPolicyRequest(), timeout=5)
    stub.ListSegments(pb.ListSegmentsRequest(), timeout=5)
    policy = finished(spans, "specd.v1.Controller/GetPolicy")
    assert policy.kind == SpanKind.SERVER
    assert policy.attributes is not None and policy.attributes["specd.policy_version"]
    assert finished(spans, "specd.v1.Controller/ListSegments").kind == SpanKind.SERVER
