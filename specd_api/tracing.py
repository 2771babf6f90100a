"""OpenTelemetry: one tracer provider per process, exporters chosen by configuration, and trace context
taken from incoming gRPC metadata so that a worker's trace continues in the controller.

The ``file`` exporter needs no collector: each finished span becomes one JSON line in the file named by
``endpoint`` (see ``span_record`` for the fields).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter, SpanExportResult
from opentelemetry.util.types import Attributes

Exporter = Literal["none", "console", "otlp_grpc", "otlp_http", "file"]

logger = logging.getLogger(__name__)


def make_exporter(kind: Exporter, endpoint: str | None) -> SpanExporter | None:
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "otlp_grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True) if endpoint else OTLPSpanExporter()
    if kind == "file":
        if not endpoint:
            raise ValueError("the file exporter needs an endpoint: the path of the JSON-lines file to append to")
        return FileSpanExporter(endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=endpoint) if endpoint else HttpExporter()


def make_provider(service_name: str, exporter: SpanExporter | None) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class FileSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to ``path`` (JSON lines), creating its folders as needed.

    Safe to share between threads (a lock) and, on a local file system, between processes: each batch is one
    ``write`` to a file opened for appending. The file is reopened per batch, so it may be rotated or deleted.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(span)) + "\n" for span in spans).encode("utf-8")
        try:
            with self._lock:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("ab", buffering=0) as out:
                    out.write(data)
        except OSError as e:
            logger.warning("cannot write %d spans to %s: %s", len(spans), self.path, e)
            return SpanExportResult.FAILURE
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing is buffered: every export has been written by the time it returns


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as plain JSON data: ids in lowercase hex (no parent: ""), times in unix nanoseconds."""
    context = span.get_span_context()
    assert context is not None, "a finished SDK span always has a context"
    return {
        "service_name": span.resource.attributes.get("service.name", ""),
        "name": span.name,
        "kind": span.kind.name,
        "trace_id": trace.format_trace_id(context.trace_id),
        "span_id": trace.format_span_id(context.span_id),
        "parent_span_id": trace.format_span_id(span.parent.span_id) if span.parent else "",
        "start_time_unix_nano": span.start_time,
        "end_time_unix_nano": span.end_time,
        "attributes": _plain_attributes(span.attributes),
        "events": [_event_record(event) for event in span.events],
        "status": {"code": span.status.status_code.name, "description": span.status.description or ""},
    }


def _event_record(event: Event) -> dict[str, Any]:
    return {"name": event.name, "time_unix_nano": event.timestamp, "attributes": _plain_attributes(event.attributes)}


def _plain_attributes(attributes: Attributes) -> dict[str, Any]:
    """Attribute values as JSON takes them: sequences (tuples in the SDK) become lists."""
    return {
        key: list(value) if isinstance(value, Sequence) and not isinstance(value, str) else value
        for key, value in (attributes or {}).items()
    }


def context_from_metadata(metadata: Iterable[tuple[str, Any]] | None) -> Context:
    """The caller's trace context from gRPC metadata (W3C traceparent / tracestate)."""
    carrier: Mapping[str, str] = {k.lower(): v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def metadata_with_context() -> list[tuple[str, str]]:
    """The current trace context as gRPC metadata, for a client call."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return list(carrier.items())


def no_tracer() -> trace.Tracer:
    return trace.NoOpTracer()
