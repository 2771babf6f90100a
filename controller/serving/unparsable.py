"""Request bytes that do not parse as their message are the caller's fault: INVALID_ARGUMENT, not INTERNAL.

gRPC answers a request deserializer that raises with an error that says the server failed (INTERNAL on the
synchronous server, UNKNOWN on grpc.aio's); yet any client can send such bytes (a string field that is not UTF-8, a
field cut short). This interceptor parses the bytes itself and refuses the ones that do not parse, naming the message
type. It wraps handlers of every flavour grpc.aio runs: synchronous ones (in the pool), coroutines and async
generators (on the loop: the health service, and WatchDecisions as ``controller.serving.grpc_server`` serves it).

``parsers`` gives a method another deserializer than its message's ``FromString``: ReportRounds is handed to its
handler as a ``serving.report_head.ReceivedReport`` (its bytes and the few fields the daemon reads), and whoever
parses the rest says what does not parse in the same words (``undecodable``).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from controller.serving.grpc_server import PerMethod
from specd_api.checks import quoted


@dataclass(frozen=True)
class Undecodable:
    """What the deserializer hands on in place of a message it could not parse: what the caller is told."""

    reason: str


def undecodable(method: str, error: DecodeError) -> str:
    """What a caller is told (INVALID_ARGUMENT) about request bytes that do not parse."""
    return f"{method}: the request does not parse: {quoted(str(error), 160)}"  # protobuf's words ("bad UTF-8")


class RefuseUndecodable(grpc.aio.ServerInterceptor):
    def __init__(self, parsers: Mapping[str, Callable[[bytes], Any]] | None = None) -> None:
        self.parsers = dict(parsers or {})  # method -> its deserializer, in place of its message's (the module)
        self._wrapped = PerMethod(self._wrap)

    async def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        return self._wrapped(details.method, await continuation(details))

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.request_deserializer is None:
            return handler  # handlers that read no bytes
        if handler.unary_unary is not None:
            behavior, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler
        elif handler.unary_stream is not None:  # WatchDecisions (and health Watch): one request, then a stream
            behavior, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
        else:
            return handler  # client streams (reflection) keep gRPC's behaviour
        parse = self.parsers.get(method, handler.request_deserializer)

        def decode(data: bytes) -> Any:
            try:
                return parse(data)
            except DecodeError as e:
                return Undecodable(undecodable(method, e))

        checked = checking(behavior)
        return make(checked, request_deserializer=decode, response_serializer=handler.response_serializer)


def checking(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """``behavior`` (of whichever flavour) behind the check: an Undecodable request is refused with
    INVALID_ARGUMENT before ``behavior`` sees it."""
    if inspect.isasyncgenfunction(behavior):

        async def checked_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return checked_stream
    if inspect.iscoroutinefunction(behavior):

        async def checked_on_loop(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
            return await behavior(request, context)

        return checked_on_loop

    def checked(request: Any, context: Any) -> Any:  # in the pool, with a synchronous context
        if isinstance(request, Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return behavior(request, context)

    return checked
