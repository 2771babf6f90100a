"""The interceptors every call goes through build their handlers once per method, not once per call (a burst of refused
calls is the event loop's work alone, so each one must cost as little as it can), and a call the token check refuses
runs none of the interceptors behind it once its method's kind is known."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from controller.serving.auth import TokenCheck, Tokens
from controller.serving.grpc_server import InFlight, PerMethod, ThreadedStreams
from controller.serving.unparsable import RefuseUndecodable

DECIDE = "/specd.v1.Controller/Decide"
WATCH = "/specd.v1.Controller/WatchDecisions"


def intercept(interceptor: grpc.aio.ServerInterceptor, handler: Any, method: str, metadata: Any = ()) -> Any:
    """What ``interceptor`` hands grpc for one call of ``method``; counts the calls of the chain behind it."""
    behind = []

    async def continuation(details: Any) -> Any:
        behind.append(details.method)
        return handler

    details = SimpleNamespace(method=method, invocation_metadata=metadata)
    result = asyncio.run(interceptor.intercept_service(continuation, details))
    return result, len(behind)


def unary() -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(lambda request, context: request, request_deserializer=bytes)


def test_each_interceptor_wraps_a_method_once_and_rewraps_a_new_handler() -> None:
    from concurrent import futures

    stream = grpc.unary_stream_rpc_method_handler(lambda request, context: iter(()), request_deserializer=bytes)
    with futures.ThreadPoolExecutor(1) as pool:
        for interceptor, handler in ((InFlight(), unary()), (RefuseUndecodable(), unary()),
                                     (ThreadedStreams(pool), stream)):  # fmt: skip
            first, _ = intercept(interceptor, handler, DECIDE)
            again, _ = intercept(interceptor, handler, DECIDE)
            assert first is not handler and again is first, type(interceptor).__name__
            other = unary() if handler is not stream else grpc.unary_stream_rpc_method_handler(
                lambda request, context: iter(()), request_deserializer=bytes)  # fmt: skip
            assert intercept(interceptor, other, DECIDE)[0] is not first  # the service changed: wrapped anew
            assert intercept(interceptor, None, "/made/Up")[0] is None


def test_the_kept_wrappings_are_bounded() -> None:
    built = []
    per_method = PerMethod(lambda handler, method: built.append(method) or handler)
    handler = unary()
    for i in range(PerMethod.LIMIT + 50):
        per_method(f"/m/{i}", handler)
    per_method("/m/0", handler)
    per_method(f"/m/{PerMethod.LIMIT + 10}", handler)  # past the limit: never kept, built again
    assert built.count("/m/0") == 1 and built.count(f"/m/{PerMethod.LIMIT + 10}") == 2


def test_a_refused_call_runs_nothing_behind_the_token_check_once_its_method_is_known() -> None:
    check = TokenCheck(Tokens(write=b"w" * 20, read=b"r" * 20))
    handler = unary()
    refused, behind = intercept(check, handler, DECIDE)
    assert behind == 1 and refused is not handler and refused.request_streaming
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        again, behind = intercept(check, handler, DECIDE, metadata)
        assert behind == 0 and again.request_streaming and not again.response_streaming
    assert intercept(check, handler, DECIDE, (("authorization", "Bearer " + "r" * 20),)) == (handler, 1)
    watch = grpc.unary_stream_rpc_method_handler(lambda request, context: iter(()))
    refused_stream, _ = intercept(check, watch, WATCH)
    assert refused_stream.response_streaming  # a streaming method's refusal is a stream too
    assert intercept(check, None, "/made/Up") == (None, 1)  # no such method: UNIMPLEMENTED, nothing kept
    assert intercept(check, None, "/made/Up") == (None, 1)


def test_the_daemon_puts_what_start_up_made_out_of_the_collectors_reach(embedded_redis_url, tmp_path) -> None:
    """A full collection walked everything the process had (50-60 ms every few reports at the size bound, every
    Decide stalled as long): start-up's objects are frozen, so a full collection walks only what came since."""
    import gc
    import sys

    from tests.daemons import running_daemon

    gc.unfreeze()
    interval = sys.getswitchinterval()
    try:
        with running_daemon(embedded_redis_url, tmp_path):
            assert gc.get_freeze_count() > 10_000  # modules, the policy, the prior, the first snapshot
            # and a thread waiting for the interpreter waits 1 ms at most, not 5, behind one that does not give it up
            assert sys.getswitchinterval() == pytest.approx(0.001)
    finally:
        gc.unfreeze()
        sys.setswitchinterval(interval)
