"""OpenTelemetry: one tracer provider per process, exporters chosen by configuration, and trace context
taken from incoming gRPC metadata so that a worker's trace continues in the controller."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

Exporter = Literal["none", "console", "otlp_grpc", "otlp_http"]


def make_exporter(kind: Exporter, endpoint: str | None) -> SpanExporter | None:
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "otlp_grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint, insecure=True) if endpoint else OTLPSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter(endpoint=endpoint) if endpoint else HttpExporter()


def make_provider(service_name: str, exporter: SpanExporter | None) -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


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
