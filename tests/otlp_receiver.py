"""A real OTLP/gRPC trace receiver for tests: what a collector would get, as plain records.

    receiver = OtlpReceiver()
    receiver.start()
    ... point an OTLPSpanExporter (or a process configured with exporter otlp_grpc) at receiver.endpoint ...
    spans = receiver.wait_for(lambda spans: len(spans) >= 2, timeout_s=10)
    receiver.stop()

Ids are lowercase hex as W3C traceparent writes them (trace 32 digits, span 16; no parent: ""), times are
unix nanoseconds, attribute values are plain Python (str, bool, int, float, bytes, list, dict).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.trace import SpanKind, StatusCode


@dataclass(frozen=True)
class ReceivedEvent:
    name: str
    time_unix_nano: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ReceivedSpan:
    service_name: str  # the resource's service.name ("" when the sender set none)
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # 16 hex digits, or "" for a root span
    attributes: dict[str, Any]
    start_time_unix_nano: int
    end_time_unix_nano: int
    status_code: StatusCode
    status_message: str = ""
    kind: SpanKind = SpanKind.INTERNAL
    events: tuple[ReceivedEvent, ...] = ()


def plain_value(value: AnyValue) -> Any:
    """An OTLP AnyValue as a Python value; an empty AnyValue is None."""
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [plain_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return plain_attributes(value.kvlist_value.values)
    return None if kind is None else getattr(value, kind)


def plain_attributes(attributes: Iterable[KeyValue]) -> dict[str, Any]:
    return {item.key: plain_value(item.value) for item in attributes}


def _span_kind(kind: int) -> SpanKind:
    """OTLP numbers kinds from SPAN_KIND_UNSPECIFIED = 0; the API from INTERNAL = 0 (unspecified reads as internal)."""
    return SpanKind(kind - 1) if kind > trace_pb2.Span.SPAN_KIND_UNSPECIFIED else SpanKind.INTERNAL


def received_spans(request: pb.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Every span in an export request, each with the service name of the resource it came under."""
    out: list[ReceivedSpan] = []
    for resource_spans in request.resource_spans:
        service_name = plain_attributes(resource_spans.resource.attributes).get("service.name", "")
        for scope_spans in resource_spans.scope_spans:
            out.extend(_received_span(span, service_name) for span in scope_spans.spans)
    return out


def _received_span(span: trace_pb2.Span, service_name: str) -> ReceivedSpan:
    return ReceivedSpan(
        service_name=service_name,
        name=span.name,
        trace_id=span.trace_id.hex(),
        span_id=span.span_id.hex(),
        parent_span_id=span.parent_span_id.hex(),
        attributes=plain_attributes(span.attributes),
        start_time_unix_nano=span.start_time_unix_nano,
        end_time_unix_nano=span.end_time_unix_nano,
        status_code=StatusCode(span.status.code),
        status_message=span.status.message,
        kind=_span_kind(span.kind),
        events=tuple(
            ReceivedEvent(event.name, event.time_unix_nano, plain_attributes(event.attributes)) for event in span.events
        ),
    )


class _TraceService(pb_grpc.TraceServiceServicer):
    def __init__(self, sink: Callable[[list[ReceivedSpan]], None]) -> None:
        self._sink = sink

    def Export(
        self, request: pb.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> pb.ExportTraceServiceResponse:
        self._sink(received_spans(request))
        return pb.ExportTraceServiceResponse()


class OtlpReceiver:
    """An OTLP/gRPC TraceService on 127.0.0.1 (a free port), keeping every span it is sent."""

    def __init__(self) -> None:
        self._spans: list[ReceivedSpan] = []
        self._arrived = threading.Condition()
        self._server: grpc.Server | None = None
        self._port = 0

    def start(self) -> None:
        assert self._server is None, "already started"
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_TraceServiceServicer_to_server(_TraceService(self._add), server)
        self._port = server.add_insecure_port("127.0.0.1:0")
        assert self._port, "could not bind a loopback port"
        server.start()
        self._server = server

    def stop(self, grace_s: float | None = None) -> None:
        if self._server is not None:
            self._server.stop(grace_s).wait()
            self._server = None

    def __enter__(self) -> OtlpReceiver:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        """``127.0.0.1:PORT``: an OTLPSpanExporter endpoint (use insecure=True) or a config's ``endpoint``."""
        assert self._server is not None, "start() the receiver first"
        return f"127.0.0.1:{self._port}"

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order (a copy)."""
        with self._arrived:
            return list(self._spans)

    def clear(self) -> None:
        with self._arrived:
            self._spans.clear()

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float = 10.0) -> list[ReceivedSpan]:
        """The spans received so far, once ``predicate(spans)`` holds; TimeoutError (naming them) if it never does.

        ``predicate`` sees all spans received, e.g. ``lambda spans: {s.name for s in spans} >= {"a", "b"}``;
        it is checked now and after every export.
        """
        with self._arrived:
            if self._arrived.wait_for(lambda: predicate(list(self._spans)), timeout_s):
                return list(self._spans)
            names = [f"{s.service_name}/{s.name}" for s in self._spans]
        raise TimeoutError(f"no match in {timeout_s}s; received {len(names)} spans: {names}")

    def _add(self, spans: Sequence[ReceivedSpan]) -> None:
        with self._arrived:
            self._spans.extend(spans)
            self._arrived.notify_all()
