"""One request, one trace, across both processes, as an OTLP collector receives it (tests/otlp_receiver.py).

The caller's W3C traceparent is continued by the worker's request span; the controller client's Decide span is
its child and carries the context over gRPC, so the controller's server span is the client span's child; the
prefill and decode spans hang under the request span and carry what the request did (segment, drafter, K,
rounds, proposed, accepted, α, tokens/s, whether a fallback was used). With the controller down, the trace says
that a fallback decided the request.
"""

from __future__ import annotations

import secrets

import httpx
from opentelemetry.trace import SpanKind

from tests.e2e.conftest import Stack, otlp_telemetry
from tests.e2e.traffic import complete, mixed_workload
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan

REQUEST = "specd.worker.request"
CLIENT_DECIDE = "specd.controller.decide"
SERVER_DECIDE = "specd.v1.Controller/Decide"
# what the request did, on its decode span (and on the request span)
DECODE_ATTRIBUTES = ("specd.segment", "specd.drafter", "specd.k", "specd.rounds", "specd.num_drafted",
                     "specd.num_accepted", "specd.alpha", "specd.tokens_per_second", "specd.fallback_used")  # fmt: skip


def traceparent() -> tuple[str, str, str]:
    """(header, trace id, parent span id) of a sampled W3C trace context."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name}: {[(s.service_name, s.name) for s in spans]}"
    return found[0]


def placed(span: ReceivedSpan) -> tuple[str, SpanKind, str]:
    """Where a span sits: the process that sent it, its kind, its parent."""
    return span.service_name, span.kind, span.parent_span_id


def in_trace(receiver: OtlpReceiver, trace_id: str, names: set[str]) -> list[ReceivedSpan]:
    """The spans of ``trace_id`` once all of ``names`` arrived."""

    def complete_trace(spans: list[ReceivedSpan]) -> bool:
        return names <= {s.name for s in spans if s.trace_id == trace_id}

    return [s for s in receiver.wait_for(complete_trace, timeout_s=30) if s.trace_id == trace_id]


def test_a_request_is_one_trace_across_worker_and_controller(stack: Stack, otlp_receiver: OtlpReceiver) -> None:
    endpoint = otlp_receiver.endpoint
    controller = stack.start_controller(telemetry=otlp_telemetry(endpoint, "specd-controller"))
    # a generous deadline: this trace must show the controller's answer, not a timeout on a busy machine
    worker = stack.start_worker(
        controller.address, decide_deadline_ms=1000, telemetry=otlp_telemetry(endpoint, "specd-worker")
    )
    prompt = next(p for p in mixed_workload(1) if p.segment == "code")
    header, trace_id, caller_span = traceparent()

    with httpx.Client(base_url=worker.url, timeout=120) as http:
        reply = complete(http, prompt, 24, headers={"traceparent": header})
        assert reply.status == 200, reply.body
        info = reply.specd
        assert info["decision_source"] == "controller", info

        spans = in_trace(
            otlp_receiver, trace_id, {REQUEST, CLIENT_DECIDE, SERVER_DECIDE, "specd.prefill", "specd.decode"}
        )
        request, client = one(spans, REQUEST), one(spans, CLIENT_DECIDE)
        server, prefill, decode = one(spans, SERVER_DECIDE), one(spans, "specd.prefill"), one(spans, "specd.decode")
        # one trace, continued from the caller's traceparent, parent links across the process boundary
        assert placed(request) == ("specd-worker", SpanKind.SERVER, caller_span)
        assert placed(client) == ("specd-worker", SpanKind.CLIENT, request.span_id)
        assert placed(server) == ("specd-controller", SpanKind.SERVER, client.span_id)
        assert prefill.parent_span_id == decode.parent_span_id == request.span_id
        assert [s for s in otlp_receiver.spans() if s.name == REQUEST] == [request], "one request, one trace"
        # both sides name the same decision
        for span in (client, server):
            assert span.attributes["specd.segment"] == "code"
            assert span.attributes["specd.drafter"] == info["drafter"]
            assert span.attributes["specd.k"] == info["k"]
        assert client.attributes["specd.decision.source"] == "controller"
        # what the request did, on the decode span (and the request span)
        assert prefill.attributes["specd.prompt_tokens"] == reply.body["usage"]["prompt_tokens"]
        for span in (decode, request):
            a = span.attributes
            assert set(DECODE_ATTRIBUTES) <= a.keys()
            assert [a["specd.segment"], a["specd.drafter"], a["specd.k"]] == [
                "code", info["drafter"], info["k"],
            ]  # fmt: skip
            assert [a["specd.rounds"], a["specd.num_drafted"], a["specd.num_accepted"]] == [
                info["num_rounds"], info["num_drafted"], info["num_accepted"],
            ]  # fmt: skip
            alpha = info["alpha"] if info["alpha"] is not None else -1.0  # None: nothing proposed (the span says -1)
            assert abs(a["specd.alpha"] - alpha) < 1e-12
            assert a["specd.tokens_per_second"] > 0
            assert a["specd.fallback_used"] is False

        # the controller down: the trace says a fallback decided the request
        controller.kill()
        header, trace_id, _ = traceparent()
        reply = complete(http, prompt, 8, headers={"traceparent": header})
        assert reply.status == 200, reply.body
        assert reply.specd["fallback"] in ("unavailable", "timeout"), reply.specd
    spans = in_trace(otlp_receiver, trace_id, {REQUEST, CLIENT_DECIDE, "specd.decode"})
    request, client, decode = one(spans, REQUEST), one(spans, CLIENT_DECIDE), one(spans, "specd.decode")
    assert SERVER_DECIDE not in {s.name for s in spans}
    assert request.attributes["specd.fallback_used"] is True and decode.attributes["specd.fallback_used"] is True
    assert request.attributes["specd.fallback"] == client.attributes["specd.fallback"] == reply.specd["fallback"]
    # the segment's last decision, unless the first one was an exploration probe (not remembered)
    assert client.attributes["specd.decision.source"] == reply.specd["decision_source"]
    assert reply.specd["decision_source"] in ("last_decision", "local_default")
