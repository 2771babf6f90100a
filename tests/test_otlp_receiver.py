"""The OTLP receiver (tests/otlp_receiver.py) gets real exports: two processes, each with the provider the
controller daemon builds (specd_api.tracing, exporter otlp_grpc), share one trace through a W3C traceparent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from specd_api.tracing import make_exporter, make_provider
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan, plain_value

REPO = Path(__file__).resolve().parents[1]

# Process "a": a root span with one attribute of each type; prints the traceparent it would send along.
PROCESS_A = """
import json, sys
from opentelemetry import propagate
from specd_api.tracing import make_exporter, make_provider

provider = make_provider("a", make_exporter("otlp_grpc", sys.argv[1]))
attributes = {"specd.segment": "chat", "specd.k": 4, "specd.expected_speedup": 1.5,
              "specd.exploration": False, "specd.drafters": ["draft", "prompt_lookup"]}
with provider.get_tracer("test.a").start_as_current_span("a.request", attributes=attributes):
    carrier = {}
    propagate.inject(carrier)
provider.shutdown()  # flushes the batch processor before the process exits
print(json.dumps(carrier))
"""

# Process "b": continues the trace it is given in TRACEPARENT with a failed SERVER span and one event.
PROCESS_B = """
import os, sys
from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Status, StatusCode
from specd_api.tracing import make_exporter, make_provider

provider = make_provider("b", make_exporter("otlp_grpc", sys.argv[1]))
parent = propagate.extract({"traceparent": os.environ["TRACEPARENT"]})
tracer = provider.get_tracer("test.b")
with tracer.start_as_current_span("b.handle", context=parent, kind=SpanKind.SERVER) as span:
    span.add_event("controller.fallback", {"specd.reason": "deadline_exceeded"})
    span.set_status(Status(StatusCode.ERROR, "refused"))
provider.shutdown()
"""


def run_process(code: str, endpoint: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter (repository importable, no OTEL_* settings inherited); its stdout."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    clean["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), clean.get("PYTHONPATH")) if p)
    result = subprocess.run(
        [sys.executable, "-c", code, endpoint],
        cwd=REPO,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def by_name(spans: list[ReceivedSpan]) -> dict[str, ReceivedSpan]:
    return {span.name: span for span in spans}


def test_a_trace_across_two_processes(otlp_receiver):
    carrier = json.loads(run_process(PROCESS_A, otlp_receiver.endpoint))
    _, trace_id, a_span_id, _ = carrier["traceparent"].split("-")
    run_process(PROCESS_B, otlp_receiver.endpoint, TRACEPARENT=carrier["traceparent"])

    spans = by_name(otlp_receiver.wait_for(lambda got: {"a.request", "b.handle"} <= set(by_name(got)), 30))
    a, b = spans["a.request"], spans["b.handle"]
    assert (a.service_name, b.service_name) == ("a", "b")  # each from its own process's resource
    # One trace: a is its root, b is a's child across the process boundary (ids as traceparent wrote them).
    assert a.trace_id == b.trace_id == trace_id
    assert (a.span_id, a.parent_span_id) == (a_span_id, "")
    assert b.parent_span_id == a.span_id != b.span_id
    assert 0 < a.start_time_unix_nano <= a.end_time_unix_nano < b.start_time_unix_nano <= b.end_time_unix_nano


def test_attributes_status_kind_and_events_arrive_as_plain_values(otlp_receiver):
    carrier = json.loads(run_process(PROCESS_A, otlp_receiver.endpoint))
    run_process(PROCESS_B, otlp_receiver.endpoint, TRACEPARENT=carrier["traceparent"])

    spans = by_name(otlp_receiver.wait_for(lambda got: len(got) == 2, 30))
    a, b = spans["a.request"], spans["b.handle"]
    assert a.attributes == {
        "specd.segment": "chat",
        "specd.k": 4,
        "specd.expected_speedup": 1.5,
        "specd.exploration": False,
        "specd.drafters": ["draft", "prompt_lookup"],
    }
    assert (a.kind, a.status_code) == (SpanKind.INTERNAL, StatusCode.UNSET)
    assert (b.kind, b.status_code, b.status_message) == (SpanKind.SERVER, StatusCode.ERROR, "refused")
    assert [(e.name, e.attributes) for e in b.events] == [
        ("controller.fallback", {"specd.reason": "deadline_exceeded"})
    ]


@pytest.mark.parametrize("kind", list(SpanKind))
def test_every_span_kind_maps_back(otlp_receiver, kind):
    # OTLP numbers kinds from UNSPECIFIED = 0, the API from INTERNAL = 0: an off-by-one would swap them all.
    exporter = make_exporter("otlp_grpc", otlp_receiver.endpoint)
    assert exporter is not None
    provider = make_provider("in-process", None)
    provider.add_span_processor(SimpleSpanProcessor(exporter))  # synchronous: exported once the span ends
    with provider.get_tracer("test").start_as_current_span("span", kind=kind) as span:
        span.set_status(Status(StatusCode.OK))
    provider.shutdown()
    (received,) = otlp_receiver.wait_for(lambda got: len(got) == 1, 10)
    assert (received.kind, received.status_code, received.service_name) == (kind, StatusCode.OK, "in-process")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        pytest.param(AnyValue(), None, id="empty"),
        pytest.param(AnyValue(int_value=-3), -3, id="int"),
        pytest.param(AnyValue(bytes_value=b"\x00\xff"), b"\x00\xff", id="bytes"),
        pytest.param(
            AnyValue(array_value=ArrayValue(values=[AnyValue(bool_value=True), AnyValue(double_value=0.5)])),
            [True, 0.5],
            id="array",
        ),
        pytest.param(
            AnyValue(kvlist_value=KeyValueList(values=[KeyValue(key="k", value=AnyValue(string_value="v"))])),
            {"k": "v"},
            id="kvlist",
        ),
    ],
)
def test_plain_value(value, expected):
    assert plain_value(value) == expected


def test_wait_for_times_out_naming_what_arrived():
    with OtlpReceiver() as receiver:
        with pytest.raises(TimeoutError, match="received 0 spans"):
            receiver.wait_for(lambda got: len(got) > 0, timeout_s=0.05)
        assert receiver.spans() == []


def test_endpoint_exists_only_while_started():
    receiver = OtlpReceiver()
    receiver.start()
    assert receiver.endpoint.startswith("127.0.0.1:")
    receiver.stop()
    with pytest.raises(AssertionError):
        _ = receiver.endpoint
