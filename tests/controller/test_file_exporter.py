"""The ``file`` exporter: traces on disk with no collector, one JSON object per finished span, and its
configuration (telemetry.exporter: file) rejected with file, line and field when the path is missing."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.trace import SpanKind, Status, StatusCode

from controller.config import ControllerConfig, TelemetryConfig, load_config
from specd_api.tracing import FileSpanExporter, make_exporter, make_provider
from specd_api.yaml_config import ConfigError, parse_yaml_model


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_spans_are_written_as_json_lines(tmp_path):
    path = tmp_path / "traces" / "nested" / "spans.jsonl"  # folders that do not exist yet
    provider = make_provider("specd-worker", make_exporter("file", str(path)))
    tracer = provider.get_tracer("test")
    attributes = {"specd.drafters": ["draft", "none"]}
    with (
        tracer.start_as_current_span("worker.request", kind=SpanKind.SERVER) as parent,
        tracer.start_as_current_span("worker.decide", attributes=attributes) as child,
    ):
        child.set_attribute("specd.k", 4)
        child.add_event("controller.fallback", {"specd.reason": "deadline_exceeded"})
        child.set_status(Status(StatusCode.ERROR, "controller unreachable"))
    provider.shutdown()  # the batch processor writes on shutdown at the latest

    child_record, parent_record = read_records(path)  # children end first
    assert isinstance(parent, ReadableSpan)
    parent_context, child_context = parent.get_span_context(), child.get_span_context()
    assert parent_record == {
        "service_name": "specd-worker",
        "name": "worker.request",
        "kind": "SERVER",
        "trace_id": f"{parent_context.trace_id:032x}",
        "span_id": f"{parent_context.span_id:016x}",
        "parent_span_id": "",
        "start_time_unix_nano": parent.start_time,
        "end_time_unix_nano": parent.end_time,
        "attributes": {},
        "events": [],
        "status": {"code": "UNSET", "description": ""},
    }
    assert child_record["trace_id"] == parent_record["trace_id"]
    assert child_record["span_id"] == f"{child_context.span_id:016x}"
    assert child_record["parent_span_id"] == parent_record["span_id"]
    assert child_record["attributes"] == {"specd.drafters": ["draft", "none"], "specd.k": 4}
    assert [(e["name"], e["attributes"]) for e in child_record["events"]] == [
        ("controller.fallback", {"specd.reason": "deadline_exceeded"})
    ]
    assert child_record["status"] == {"code": "ERROR", "description": "controller unreachable"}
    assert parent.start_time <= child_record["start_time_unix_nano"] <= child_record["end_time_unix_nano"]


def test_appends_to_an_existing_file(tmp_path):
    path = tmp_path / "spans.jsonl"
    for service in ("specd-controller", "specd-worker"):  # e.g. two processes pointed at one file
        provider = make_provider(service, make_exporter("file", str(path)))
        provider.get_tracer("test").start_span("span").end()
        provider.shutdown()
    assert [r["service_name"] for r in read_records(path)] == ["specd-controller", "specd-worker"]


def test_concurrent_exports_never_interleave(tmp_path):
    # Large spans from many threads at once: without the lock and the one-write-per-batch, lines would tear.
    path = tmp_path / "spans.jsonl"
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(FileSpanExporter(path)))
    tracer = provider.get_tracer("test")
    threads, spans_per_thread, padding = 8, 25, "x" * 20_000

    def emit(thread: int) -> None:
        for i in range(spans_per_thread):
            tracer.start_span(f"t{thread}.{i}", attributes={"padding": padding}).end()

    workers = [threading.Thread(target=emit, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    provider.shutdown()

    records = read_records(path)  # json.loads fails on any torn line
    assert sorted(r["name"] for r in records) == sorted(
        f"t{t}.{i}" for t in range(threads) for i in range(spans_per_thread)
    )
    assert all(r["attributes"]["padding"] == padding for r in records)


def test_an_unwritable_path_fails_the_export_without_raising(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter := FileSpanExporter(blocker / "spans.jsonl")))
    span = provider.get_tracer("test").start_span("span")
    span.end()
    assert exporter.export([span]) == SpanExportResult.FAILURE  # type: ignore[list-item]
    provider.shutdown()


def test_make_exporter_needs_a_path():
    with pytest.raises(ValueError, match="needs an endpoint"):
        make_exporter("file", None)


def _config_issues(text: str) -> list[tuple[int | None, str, str]]:
    with pytest.raises(ConfigError) as caught:
        parse_yaml_model(text, ControllerConfig, "controller.yaml")
    return [(issue.line, issue.field, issue.message) for issue in caught.value.issues]


@pytest.mark.parametrize(
    ("text", "line"),
    [
        # no endpoint key at all: the telemetry section is blamed (pydantic validates the default too)
        pytest.param("listen: 127.0.0.1:0\ntelemetry:\n  exporter: file\n", 2, id="absent"),
        # an explicit null or empty string: the endpoint key itself
        pytest.param("telemetry:\n  exporter: file\n  endpoint: null\n", 3, id="null"),
        pytest.param("telemetry:\n  exporter: file\n  endpoint: ''\n", 3, id="empty"),
    ],
)
def test_file_exporter_without_endpoint_is_a_config_error(text, line):
    ((got_line, field, message),) = _config_issues(text)
    assert (got_line, field) == (line, "telemetry.endpoint")
    assert "file exporter needs an endpoint" in message


def test_unknown_exporter_lists_file_among_the_choices():
    ((line, field, message),) = _config_issues("telemetry:\n  exporter: files\n")
    assert (line, field) == (2, "telemetry.exporter")
    assert "'file'" in message


@pytest.mark.parametrize("exporter", ["none", "console", "otlp_grpc", "otlp_http"])
def test_other_exporters_need_no_endpoint(exporter):
    # OTLP exporters fall back to their default endpoint (or OTEL_EXPORTER_OTLP_ENDPOINT).
    assert TelemetryConfig.model_validate({"exporter": exporter}).endpoint is None


def test_relative_file_path_is_resolved_against_the_config_folder(tmp_path):
    config_path = tmp_path / "etc" / "controller.yaml"
    config_path.parent.mkdir()
    config_path.write_text("telemetry:\n  exporter: file\n  endpoint: ../traces/controller.jsonl\n")
    assert load_config(config_path).telemetry.endpoint == str(tmp_path / "etc" / ".." / "traces" / "controller.jsonl")


def test_absolute_file_path_and_otlp_endpoints_are_kept(tmp_path):
    absolute = tmp_path / "spans.jsonl"
    config_path = tmp_path / "controller.yaml"
    config_path.write_text(f"telemetry:\n  exporter: file\n  endpoint: {absolute}\n")
    assert load_config(config_path).telemetry.endpoint == str(absolute)
    config_path.write_text("telemetry:\n  exporter: otlp_grpc\n  endpoint: collector:4317\n")
    assert load_config(config_path).telemetry.endpoint == "collector:4317"
