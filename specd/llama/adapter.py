"""The engine adapter: an OpenAI-compatible ``/v1/completions`` in front of llama.cpp's servers, one per speculation
setting (``specd.llama.endpoints``), steered per request by the controller.

For each request it tokenizes the prompt (in process with the served model's tokenizer, else the plain server's
``/tokenize``), names its segment (the request's
``segment`` field or ``X-Specd-Segment`` header, else the configured one or the worker's prompt classifier), asks the
controller through the client library (its deadline, pushed tables and fail-open fallbacks: a controller that does
not answer never fails a request) unless the request names its own ``speculation`` (drafter and K, as the worker's
API takes it), routes the plan to an endpoint, forwards the token ids, streams the answer back,
and reports the request's totals (``timings``: tokens, seconds, drafted, accepted) as ``RequestTotals``.

The response's ``specd`` block says which endpoint ran the request and why. Greedy output is the endpoint's own:
the adapter forwards the ids and the sampling fields unchanged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from decoder.worker.openai_api import (
    CompletionRequest,
    SpeculationChoice,
    completion_body,
    error_body,
    new_id,
    usage,
)
from decoder.worker.segments import classify_prompt
from specd.llama.adapter_config import AdapterConfig
from specd.llama.endpoints import Setting, offered, route
from specd.llama.ngram_simple import scored as lookup_scored
from specd_api.plan import Plan, local_plan, requested, runnable, speculation_allowed
from specd_api.request_features import RequestFeatures
from specd_api.segments import validate_segment
from specd_client import ControllerClient, RequestTotals, self_repetition

log = logging.getLogger("specd.llama.adapter")
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
QUIET_SECONDS = 2.0  # prompt lookup's replay waits at most this long for no request to be in flight


@dataclass(frozen=True)
class Routed:
    """What a request runs under: its plan, the endpoint it went to (``Adapter.urls`` holds its URL), and the
    features it was decided on."""

    plan: Plan
    setting: Setting
    features: RequestFeatures
    prompt_ids: tuple[int, ...]
    caller_choice: SpeculationChoice | None = None  # the request named its own drafter and K


class InFlight:
    """The requests in the adapter now; ``wait_idle`` is the client library's ``quiet``: its reports are sent, and its
    pushed tables read, once no request is in flight (or after the wait's bound), not beside a decode."""

    def __init__(self) -> None:
        self._count = 0
        self._changed = threading.Condition()

    def enter(self) -> int:
        """One more request; the count with it."""
        with self._changed:
            self._count += 1
            return self._count

    def leave(self) -> None:
        with self._changed:
            self._count -= 1
            self._changed.notify_all()

    def wait_idle(self, seconds: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self._count == 0, timeout=seconds)


class EngineError(Exception):
    """An endpoint failed the request (unreachable, or an error status): a 502 naming the endpoint."""


class Adapter:
    """The adapter's state: the endpoints' URLs by setting, one HTTP client, the controller client (None: no
    controller; every request plain unless the local default says otherwise), and the requests in flight."""

    def __init__(
        self, config: AdapterConfig, urls: dict[Setting, str], client: ControllerClient | None,
        tokenizer: Callable[[str], list[int]] | None = None, in_flight: InFlight | None = None,
    ) -> None:  # fmt: skip
        """``tokenizer``: the served model's, in this process (None: the plain server's /tokenize); ``in_flight``:
        the counter the client library waits on (``InFlight.wait_idle``)."""
        self.config = config
        self.in_flight = in_flight or InFlight()
        self.tokenizer = tokenizer
        self.urls = urls
        self.settings = tuple(urls)
        self.drafters = offered(self.settings)
        self.client = client
        # no Nagle: a request's head and body leave at once, whatever the acknowledgements
        transport = httpx.AsyncHTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self.http = httpx.AsyncClient(timeout=config.request_timeout_seconds, transport=transport)
        self._reporter = ThreadPoolExecutor(1, thread_name_prefix="specd-adapter-scoring")

    @property
    def plain_url(self) -> str:
        return self.urls[Setting("none", 0)]

    async def close(self) -> None:
        await self.http.aclose()
        self._reporter.shutdown(wait=True)

    # --- one request ------------------------------------------------------------------------------

    async def tokenize(self, prompt: str | list[str] | list[int]) -> list[int]:
        text = prompt_text(prompt)
        if text is None:
            return [int(t) for t in prompt]
        if self.tokenizer is not None:
            return self.tokenizer(text)
        return await self.server_tokens(text)

    async def server_tokens(self, text: str) -> list[int]:
        """``text`` as the plain server tokenizes a prompt (its special tokens added)."""
        answer = await self._post(self.plain_url, "/tokenize", {"content": text, "add_special": True})
        return [int(t) for t in answer["tokens"]]

    def segment(self, body: CompletionRequest, header: str | None, text: str, repetition: float) -> str:
        named = body.segment or header
        if named:
            return validate_segment(named)
        if self.config.segment != "classify":
            return self.config.segment
        return classify_prompt(text, repetition)

    async def decide(self, body: CompletionRequest, ids: list[int], segment: str, repetition: float) -> Routed:
        batch = self.in_flight.enter()
        features = RequestFeatures(
            segment=segment, batch_size=batch, drafters=self.drafters, temperature=body.temperature,
            top_p=body.top_p, top_k=body.top_k, prompt_tokens=len(ids),
            max_new_tokens=body.max_tokens or DEFAULT_MAX_TOKENS, self_repetition=repetition,
        )  # fmt: skip
        if body.speculation is not None:
            plan = requested(body.speculation.drafter, body.speculation.k)
        elif self.client is not None:
            plan = await asyncio.to_thread(self.client.decide, features)
        else:
            link = self.config.controller
            plan = local_plan(link.default_drafter, link.default_k, self.drafters, batch,
                              self.config.speculation_max_batch, None)  # fmt: skip
        plan = runnable(plan, self.drafters, self.config.speculation_max_batch)  # the batch threshold, resolved once
        threshold = plan.max_batch_size or self.config.speculation_max_batch  # set by runnable
        drafter, k = (plan.drafter, plan.k) if speculation_allowed(batch, threshold) else ("none", 0)
        chosen = route(drafter, k, self.settings)
        return Routed(plan, chosen, features, tuple(ids), body.speculation)

    def done(self, routed: Routed, answer: dict[str, Any], generated: Sequence[int] = ()) -> None:
        """The request left the adapter: its totals reported (when a controller is configured), with prompt lookup
        scored over its output ``generated`` where the plan asks for it and prompt lookup did not serve it (by
        llama-server's own rule, ``ngram_simple.scored``); the scoring (about 0.6 ms) runs on the reporter's thread
        once no request is in flight."""
        self.in_flight.leave()
        timings = answer.get("timings") or {}
        chosen = routed.caller_choice
        client = self.client
        if client is None or not timings or (chosen is not None and not chosen.report):
            return
        f, s = routed.features, routed.setting
        totals = RequestTotals(
            segment=f.segment, drafter=s.drafter, k=s.k, tokens=int(timings.get("predicted_n", 0)),
            seconds=float(timings.get("predicted_ms", 0.0)) / 1000.0, drafted=int(timings.get("draft_n", 0)),
            accepted=int(timings.get("draft_n_accepted", 0)), batch_size=f.batch_size, temperature=f.temperature,
            prompt_tokens=f.prompt_tokens, self_repetition=f.self_repetition,
            expected_speedup=routed.plan.model_speedup if chosen is None else 0.0,
        )  # fmt: skip
        k = dict(routed.plan.counterfactual_ks).get("prompt_lookup", 0)
        if k <= 0 or s.drafter == "prompt_lookup" or not generated:
            client.report_totals(totals)
            return
        budget = routed.features.max_new_tokens  # the server's: its rounds near the end draft within it

        def score_and_report() -> None:
            self.in_flight.wait_idle(QUIET_SECONDS)
            client.report_totals(totals, lookup_scored(routed.prompt_ids, generated, k, budget))

        self._reporter.submit(score_and_report)

    def engine_body(self, body: CompletionRequest, ids: list[int], stream: bool) -> dict[str, Any]:
        """llama-server's /completion body: the ids and the sampling fields as the request gave them."""
        out: dict[str, Any] = {
            "prompt": ids, "n_predict": body.max_tokens or DEFAULT_MAX_TOKENS, "temperature": body.temperature,
            "top_p": body.top_p, "top_k": body.top_k, "stream": stream, "return_tokens": True,
        }  # fmt: skip
        if body.seed is not None:
            out["seed"] = body.seed % (1 << 32)
        if body.stop_strings():
            out["stop"] = list(body.stop_strings())
        return out

    async def _post(self, url: str, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            answer = await self.http.post(url + path, json=payload)
        except httpx.HTTPError as e:
            raise EngineError(f"{url}{path}: {type(e).__name__}: {e}") from None
        if answer.status_code != 200:
            raise EngineError(f"{url}{path} answered {answer.status_code}: {answer.text[:300]}")
        return dict(answer.json())

    async def complete(self, routed: Routed, payload: dict[str, Any]) -> dict[str, Any]:
        try:
            answer = await self._post(self.urls[routed.setting], "/completion", payload)
        except BaseException:
            self.done(routed, {})
            raise
        self.done(routed, answer, [int(t) for t in answer.get("tokens") or ()])
        return answer

    async def stream(self, routed: Routed, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """llama-server's stream, chunk by chunk (the last carries ``stop`` and ``timings``)."""
        url = self.urls[routed.setting]
        last: dict[str, Any] = {}
        generated: list[int] = []
        try:
            async with self.http.stream("POST", url + "/completion", json=payload) as answer:
                if answer.status_code != 200:
                    raise EngineError(f"{url}/completion answered {answer.status_code}")
                async for line in answer.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    chunk = json.loads(line[6:])
                    generated += [int(t) for t in chunk.get("tokens") or ()]
                    if chunk.get("stop"):
                        last = chunk
                    yield chunk
        except httpx.HTTPError as e:
            raise EngineError(f"{url}/completion: {type(e).__name__}: {e}") from None
        finally:
            self.done(routed, last, generated)


def prompt_text(prompt: str | list[str] | list[int]) -> str | None:
    """A completion request's prompt as text; None when it was sent as token ids."""
    if isinstance(prompt, str):
        return prompt
    first = prompt[0] if prompt else ""
    return first if isinstance(first, str) else None


def speculation_block(routed: Routed, answer: dict[str, Any]) -> dict[str, Any]:
    timings = answer.get("timings") or {}
    plan = routed.plan
    return {
        "segment": routed.features.segment, "endpoint": routed.setting.name, "drafter": plan.drafter, "k": plan.k,
        "reason": plan.reason, "expected_speedup": plan.expected_speedup, "exploration": plan.exploration,
        "source": plan.origin.source, "tokens": int(timings.get("predicted_n", 0)),
        "drafted": int(timings.get("draft_n", 0)),
        "accepted": int(timings.get("draft_n_accepted", 0)),
    }  # fmt: skip


def finish_reason(answer: dict[str, Any]) -> str:
    return "length" if answer.get("stop_type") == "limit" else "stop"


def make_app(adapter: Adapter) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await adapter.close()

    app = FastAPI(title="specd llama.cpp adapter", lifespan=lifespan)
    model = adapter.config.model_name

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        field = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return JSONResponse(error_body(str(first.get("msg", "invalid request")), "invalid_request_error", field),
                            status_code=400)  # fmt: skip

    @app.exception_handler(EngineError)
    async def _engine(request: Request, exc: EngineError) -> JSONResponse:
        return JSONResponse(error_body(f"the engine failed: {exc}", "engine_error"), status_code=502)

    @app.get("/health")
    async def health() -> Response:
        return JSONResponse({"status": "ok", "endpoints": [s.name for s in adapter.settings]})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "specd"}]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response | dict[str, Any]:
        try:
            header = request.headers.get("x-specd-segment")
            segment_named = body.segment or header
            if segment_named:
                validate_segment(segment_named)
        except ValueError as e:
            return JSONResponse(error_body(str(e), "invalid_request_error", "segment"), status_code=400)
        ids = await adapter.tokenize(body.prompt)
        repetition = self_repetition(ids)
        segment = adapter.segment(body, header, prompt_text(body.prompt) or "", repetition)
        routed = await adapter.decide(body, ids, segment, repetition)
        request_id = new_id("cmpl")
        if not body.stream:
            answer = await adapter.complete(routed, adapter.engine_body(body, ids, stream=False))
            produced = int((answer.get("timings") or {}).get("predicted_n", len(answer.get("tokens") or [])))
            return completion_body(request_id, model, str(answer.get("content", "")), finish_reason(answer),
                                   usage(len(ids), produced), speculation_block(routed, answer))  # fmt: skip

        async def events() -> AsyncIterator[str]:
            async for chunk in adapter.stream(routed, adapter.engine_body(body, ids, stream=True)):
                done = bool(chunk.get("stop"))
                choice = {"index": 0, "text": str(chunk.get("content", "")), "logprobs": None,
                          "finish_reason": finish_reason(chunk) if done else None}  # fmt: skip
                out: dict[str, Any] = {"id": request_id, "object": "text_completion", "model": model,
                                       "choices": [choice]}  # fmt: skip
                if done:
                    out["specd"] = speculation_block(routed, chunk)
                yield f"data: {json.dumps(out)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app
