"""Request bytes that do not parse as their message are the caller's fault: INVALID_ARGUMENT, not INTERNAL.

gRPC answers a request deserializer that raises with INTERNAL ("Exception deserializing request!"), which says the
server failed; yet any client can send such bytes (a string field that is not UTF-8, a field cut short). This
interceptor parses the bytes itself and refuses the ones that do not parse, naming the message type.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from specd_api.checks import quoted


@dataclass(frozen=True)
class Undecodable:
    """What the deserializer hands on in place of a message it could not parse."""

    reason: str


class RefuseUndecodable(grpc.ServerInterceptor):
    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler  # handlers that read no bytes
        if handler.unary_unary is not None:
            behavior, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler
        elif handler.unary_stream is not None:  # WatchDecisions (and health Watch): one request, then a stream
            behavior, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
        else:
            return handler  # client streams (reflection) keep gRPC's behaviour
        parse = handler.request_deserializer
        method = details.method

        def decode(data: bytes) -> Any:
            try:
                return parse(data)
            except DecodeError as e:
                return Undecodable(quoted(str(e), 160))  # protobuf's words ("String field had bad UTF-8")

        def checked(request: Any, context: grpc.ServicerContext, *callback: Any) -> Any:
            if isinstance(request, Undecodable):
                reason = f"{method}: the request does not parse: {request.reason}"
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, reason)
            return behavior(request, context, *callback)  # a non-blocking stream's send_response_callback

        keep_non_blocking(behavior, checked)
        return make(checked, request_deserializer=decode, response_serializer=handler.response_serializer)


NON_BLOCKING = ("experimental_non_blocking", "experimental_thread_pool")


def keep_non_blocking(behavior: Callable[..., Any], wrapper: Callable[..., Any]) -> None:
    """Give ``wrapper`` the non-blocking marks of ``behavior``: gRPC runs a stream so marked (the health service's
    Watch) without holding a pool thread for its life. A wrapper without them made every Watch stream hold one, and
    about 270 unauthenticated Watch streams starved every Decide (issue 22)."""
    for name in NON_BLOCKING:
        if hasattr(behavior, name):
            setattr(wrapper, name, getattr(behavior, name))
