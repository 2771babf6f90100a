"""The worker's HTTP API: OpenAI-compatible completions and chat (streaming with server-sent events, or
not), plus /health, /v1/models and Prometheus /metrics. Everything else lives in WorkerService."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate
from starlette.exceptions import HTTPException

from decoder.capped_encoding import PromptTooLong
from decoder.sampling import SamplingParams
from decoder.worker.auth import TENANT_STATE, ApiKeyCheck
from decoder.worker.client_segments import SegmentRefused
from decoder.worker.config import ClientSpeculation, TenantKey
from decoder.worker.limits import BodyLimit, clip, quote
from decoder.worker.openai_api import (
    ChatRequest,
    CompletionRequest,
    SpeculationChoice,
    chat_body,
    chat_chunk,
    completion_body,
    error_body,
    new_id,
    render_chat,
    usage,
)
from decoder.worker.segments import CLASSIFIER_SEGMENTS
from decoder.worker.service import Event, QueueFull, RequestSpec, ShuttingDown, Speculation, WorkerService
from decoder.worker.tokenizing import Tokenizing
from specd_api.errors import SpecdError
from specd_api.host_counts import client_host
from specd_api.segments import SEGMENT_PATTERN

SEGMENT_HEADER = "x-specd-segment"
RETRY_AFTER_SECONDS = 1


_ERROR_KINDS = {403: "permission_error", 404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if status in (429, 503) else None
    return JSONResponse(error_body(clip(message), kind, param), status_code=status, headers=headers)


def build_app(service: WorkerService) -> FastAPI:
    cfg = service.cfg
    limits = cfg.limits
    service.metrics.bound_segments(cfg.metrics.max_segments, reserved=(cfg.default_segment, *CLASSIFIER_SEGMENTS))
    # Tokenizing runs off the event loop (a 5 MB prompt takes seconds), in two lanes of one thread each, shared
    # fairly among client hosts (decoder/worker/tokenizing.py): a burst of large prompts costs one prompt's memory
    # at a time and holds up neither small prompts nor other hosts' prompts.
    tokenizing = Tokenizing()

    async def tokenized(request: Request, chars: int, param: str, work: Callable[[int], list[int]]) -> list[int]:
        """``work(cap)`` (tokenizing a prompt of ``chars`` characters, stopping past ``cap`` tokens) in its lane."""
        try:
            return await tokenizing.run(chars, request_host(request), lambda: work(limits.max_prompt_tokens))
        except PromptTooLong as e:
            raise BadRequest(param, f"at least {e.at_least} tokens is above this worker's limit of {e.cap} "
                                    "(limits.max_prompt_tokens)") from None  # fmt: skip

    app = FastAPI(title="specd worker", docs_url=None, redoc_url=None)
    app.add_middleware(
        BodyLimit, max_bytes=limits.max_request_bytes,
        error=lambda message: error(413, message, "invalid_request_error"),
    )  # fmt: skip
    credentials = cfg.auth.credentials()
    if credentials:  # added last, so it runs first: no key, no body read
        open_paths = [path for path, access in (("/health", cfg.auth.health), ("/metrics", cfg.auth.metrics))
                      if access == "open"]  # fmt: skip
        app.add_middleware(ApiKeyCheck, keys=credentials, open_paths=open_paths)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":  # its loc is a character offset, not a field
            reason = (first.get("ctx") or {}).get("error", "invalid JSON")
            return error(400, f"the request body is not valid JSON ({reason})", "invalid_request_error")
        where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
        message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
        return error(400, f"{where}: {message}" if where else message, "invalid_request_error", where or None)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own refusals (a body that is not JSON text, an unknown path) in the OpenAI shape."""
        message = str(exc.detail)
        if message == "There was an error parsing the body":  # FastAPI's words for a body json.loads refused
            message = "the request body could not be parsed as JSON"
        return error(exc.status_code, message, _ERROR_KINDS.get(exc.status_code, "invalid_request_error"))

    @app.get("/health")
    async def health() -> JSONResponse:
        scheduler = service.scheduler
        body = {
            "status": "ok" if service.healthy else ("draining" if service.draining else "failed"),
            "model": service.model_name,
            "queue_depth": scheduler.queue_depth if scheduler else 0,
            "batch_size": scheduler.batch_size if scheduler else 0,
            "controller": service.cfg.controller.address,
        }
        return JSONResponse(body, status_code=200 if service.healthy else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": service.model_name, "object": "model", "created": int(service.started_unix), "owned_by": "specd"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def metrics() -> Response:
        if service.scheduler is not None:  # as of now: the last step's batch may be long gone
            service.metrics.queue_depth.set(service.scheduler.queue_depth)
            service.metrics.batch_size.set(service.scheduler.batch_size)
        return Response(service.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    def bounded(ids: list[int], param: str) -> list[int]:
        if len(ids) > limits.max_prompt_tokens:
            raise BadRequest(param, f"{len(ids)} tokens is above this worker's limit of {limits.max_prompt_tokens} "
                                    "(limits.max_prompt_tokens)")  # fmt: skip
        return ids

    def check_chars(chars: int, param: str) -> None:
        if chars > limits.max_prompt_chars:
            raise BadRequest(param, f"{chars} characters is above this worker's limit of {limits.max_prompt_chars} "
                                    "(limits.max_prompt_chars)")  # fmt: skip

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        async def prompt() -> tuple[str | None, list[int]]:
            if not isinstance(body.prompt, str) and not isinstance(body.prompt[0], str):
                return None, bounded([int(t) for t in body.prompt], "prompt")
            text = body.prompt if isinstance(body.prompt, str) else str(body.prompt[0])
            check_chars(len(text), "prompt")
            return text, await tokenized(request, len(text), "prompt", lambda cap: service.encode(text, cap))

        return await serve(service, body, request, prompt, completion_shapes)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Response:
        async def prompt() -> tuple[str | None, list[int]]:
            chars = sum(len(m.text()) for m in body.messages)
            check_chars(chars, "messages")
            text = ""

            def render_and_encode(cap: int) -> list[int]:
                nonlocal text
                text = render_chat(body.messages, service.tokenizer)  # a chat template can be slow too
                return service.encode(text, cap)

            ids = await tokenized(request, chars, "messages", render_and_encode)
            return text, ids

        return await serve(service, body, request, prompt, chat_shapes)

    return app


# -- request handling ---------------------------------------------------------------------------------------


class Shapes:
    """How one endpoint words its responses."""

    def __init__(
        self,
        full: Callable[..., dict[str, Any]],
        chunk: Callable[[str, str, str | None, str | None, dict[str, int] | None], dict[str, Any]],
        id_kind: str,
    ) -> None:
        self.full, self.chunk, self.id_kind = full, chunk, id_kind


def _completion_chunk(
    request_id: str, model: str, text: str | None, finish: str | None, use: dict[str, int] | None
) -> dict[str, Any]:
    body = completion_body(request_id, model, text or "", finish, use, {})
    if text is None and finish is None:
        body["choices"] = []
    return body


def _chat_chunk(
    request_id: str, model: str, text: str | None, finish: str | None, use: dict[str, int] | None
) -> dict[str, Any]:
    delta = {"content": text} if text is not None else {}
    return chat_chunk(request_id, model, delta, finish, use)


completion_shapes = Shapes(completion_body, _completion_chunk, "cmpl")
chat_shapes = Shapes(chat_body, _chat_chunk, "chatcmpl")


class BadRequest(ValueError):
    """A request the worker refuses (400), naming the field at fault."""

    status, kind = 400, "invalid_request_error"

    def __init__(self, param: str, reason: str) -> None:
        super().__init__(f"{param}: {reason}")
        self.param = param


class Forbidden(BadRequest):
    """A field the request's key may not set (403)."""

    status, kind = 403, "permission_error"


def request_host(request: Request) -> str:
    """The client host a request counts under in every per-host share (``specd_api.host_counts.client_host``)."""
    return client_host(request.client.host) if request.client is not None else ""


def tenant_segment(request: Request, named: str | None) -> tuple[str | None, str]:
    """The segment a request names, checked against its key (``auth.tenants``), and the prefix of the segment the
    worker infers for it where it names none ('' for the operator's key, or without keys). Forbidden: a tenant's key
    naming a segment outside its globs."""
    tenant: TenantKey | None = getattr(request.state, TENANT_STATE, None)
    if tenant is None:
        return named, ""
    if named is not None and not tenant.allows(named):
        raise Forbidden("segment", f"{quote(named)} is not a segment this key may name "
                                   f"(auth.tenants[{tenant.name}].segments)")  # fmt: skip
    return named, f"{tenant.name}/"


def request_spec(service: WorkerService, body: Any, request: Request, text: str | None, ids: list[int]) -> RequestSpec:
    cfg = service.cfg
    max_tokens = body.max_tokens or cfg.default_max_tokens
    if max_tokens > cfg.max_tokens_limit:
        raise BadRequest("max_tokens", f"{max_tokens} is above this worker's limit of {cfg.max_tokens_limit}")
    vocab_size = service.vocab_size
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:  # an embedding lookup past the table would fail the whole decode batch
        raise BadRequest("prompt", f"token id {outside[0]} is outside the vocabulary (0..{vocab_size - 1})")
    segment = body.segment or request.headers.get(SEGMENT_HEADER)
    if segment is not None and not re.fullmatch(SEGMENT_PATTERN, segment):  # the header obeys the body's rule
        raise BadRequest("segment", f"{quote(segment)} (X-Specd-Segment header) should match {SEGMENT_PATTERN}")
    segment, inferred_prefix = tenant_segment(request, segment)
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed)
    check_speculation(body.speculation, cfg.client_speculation)
    if segment is not None:  # last: a request refused for another field takes no place
        try:
            # None: served under the segment the worker infers
            segment = service.client_segment(segment, request_host(request))
        except SegmentRefused as e:
            raise BadRequest("segment", str(e)) from None
    return RequestSpec(
        prompt_text=text,
        prompt_ids=ids,
        max_new_tokens=max_tokens,
        params=params,
        stop_strings=body.stop_strings(),
        segment=segment,
        inferred_prefix=inferred_prefix,
        trace_context=propagate.extract(dict(request.headers)),
        stream=bool(body.stream),
        share_outputs=body.share_outputs,
        speculation=(
            Speculation(body.speculation.drafter, body.speculation.k, body.speculation.report)
            if body.speculation is not None
            else None
        ),
    )


def check_speculation(chosen: SpeculationChoice | None, bounds: ClientSpeculation) -> None:
    """A client's own drafter and K are bounded by the worker's ``client_speculation``: four requests at K=64 once
    slowed every other request ~10x (each verify pass 65 tokens wide, each round 64 draft passes)."""
    if chosen is None:
        return
    if not bounds.allowed:
        raise BadRequest("speculation", "this worker does not take a client's choice of drafter and K "
                                        "(client_speculation.allowed is false)")  # fmt: skip
    if chosen.k > bounds.max_k:
        raise BadRequest("speculation.k", f"{chosen.k} is above this worker's limit of {bounds.max_k} "
                                          "(client_speculation.max_k)")  # fmt: skip


async def serve(
    service: WorkerService, body: Any, request: Request, prompt: Callable[[], Awaitable[tuple[str | None, list[int]]]],
    shapes: Shapes,
) -> Response:  # fmt: skip
    """Answer a parsed request: the model check, then ``prompt()`` (its text and token ids, tokenized off the event
    loop), then the decode."""
    if body.model not in (None, "", service.model_name):
        return error(404, f"model {quote(body.model)} is not served here (try {service.model_name!r})",
                     "not_found_error", "model")  # fmt: skip
    try:
        text, ids = await prompt()
        spec = request_spec(service, body, request, text, ids)
    except BadRequest as e:
        return error(e.status, str(e), e.kind, e.param)
    except (ValueError, SpecdError) as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        return error(400, message, "invalid_request_error")
    events = service.run_request(spec)
    try:
        first = await anext(events)  # queueing errors surface here, before any byte is sent
    except QueueFull as e:
        return error(429, f"the worker is at capacity ({e}); retry shortly", "rate_limit_error")
    except ShuttingDown as e:
        return error(503, str(e), "service_unavailable")
    request_id = new_id(shapes.id_kind)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            sse(service, shapes, request_id, first, events, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await collect(service, shapes, request_id, first, events, request)


async def collect(
    service: WorkerService, shapes: Shapes, request_id: str, first: Event, events: AsyncGenerator[Event, None],
    request: Request,
) -> Response:  # fmt: skip
    """A non-streaming answer; cancels the decode when the client disconnects while it waits."""
    parts: list[str] = []
    event: Event | None = first

    async def watch() -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(0.1)

    watcher = asyncio.ensure_future(watch())
    try:
        while event is not None and event.kind in ("accepted", "text"):
            parts.append(event.text)
            nxt = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if nxt not in done:  # the client went away
                nxt.cancel()  # cancels the decode (run_request's finally); the generator is closed once it has run
                await asyncio.wait({nxt})
                await events.aclose()
                return Response(status_code=499)
            event = nxt.result()
    finally:
        watcher.cancel()
    assert event is not None
    if event.kind == "error":
        kind = "server_error" if event.status >= 500 else "invalid_request_error"
        return error(event.status, event.error or "failed", kind)
    use = usage(event.prompt_tokens, event.completion_tokens)
    body = shapes.full(request_id, service.model_name, "".join(parts), event.finish_reason, use, event.specd)
    return JSONResponse(body)


async def sse(
    service: WorkerService, shapes: Shapes, request_id: str, first: Event, events: AsyncGenerator[Event, None],
    include_usage: bool,
) -> AsyncIterator[bytes]:  # fmt: skip
    """Server-sent events: a chunk per text delta, a final chunk with finish_reason, then [DONE].
    When the client disconnects, Starlette cancels this generator and closing ``events`` cancels the decode."""
    model = service.model_name

    def data(payload: dict[str, Any]) -> bytes:
        return f"data: {json.dumps(payload)}\n\n".encode()

    try:
        if shapes is chat_shapes:
            yield data(chat_chunk(request_id, model, {"role": "assistant", "content": ""}, None))
        event: Event = first
        while True:
            if event.kind == "accepted":
                pass
            elif event.kind == "text":
                yield data(shapes.chunk(request_id, model, event.text, None, None))
            elif event.kind == "done":
                final = shapes.chunk(request_id, model, None, event.finish_reason, None)
                final["specd"] = event.specd
                yield data(final)
                if include_usage:
                    use = usage(event.prompt_tokens, event.completion_tokens)
                    yield data(shapes.chunk(request_id, model, None, None, use))
                break
            else:
                yield data(error_body(event.error or "failed", "server_error"))
                break
            event = await anext(events)
        yield b"data: [DONE]\n\n"
    finally:
        await events.aclose()
