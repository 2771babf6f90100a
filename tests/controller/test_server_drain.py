"""What the controller daemon's drain counts (controller/server.py): the RPCs in flight, the ones the grace period
cut short, and a second Ctrl-C cancelling them at once. A real gRPC server (serving/grpc_server.py, as the daemon
serves) whose one method blocks until told."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from controller.config import ControllerConfig
from controller.server import ControllerDaemon
from controller.serving.grpc_server import GrpcServer, InFlight

METHOD = "/test.Slow/Wait"


class Slow:
    """A server with InFlight and one unary method that waits for ``release`` (or 10 s)."""

    def __init__(self, in_flight: InFlight) -> None:
        self.release = threading.Event()
        handler = grpc.unary_unary_rpc_method_handler(self._wait)
        generic = grpc.method_handlers_generic_handler("test.Slow", {"Wait": handler})
        self.server = GrpcServer(4, [in_flight], [])
        self.port = self.server.start("127.0.0.1:0", None, lambda server: server.add_generic_rpc_handlers((generic,)))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")

    def _wait(self, request: bytes, context: Any) -> bytes:
        self.release.wait(10)
        return b"done"

    def call(self) -> threading.Thread:
        def go() -> None:
            with contextlib.suppress(grpc.RpcError):  # cancelled by the stop: what the test counts
                self.channel.unary_unary(METHOD)(b"", timeout=15)

        thread = threading.Thread(target=go)
        thread.start()
        return thread


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[ControllerDaemon]:
    """A daemon that never started: the tests give it a server of their own."""
    config = ControllerConfig(
        listen="127.0.0.1:0", policy_path=tmp_path / "p.yaml", state_dir=tmp_path, shutdown_grace_seconds=0.3
    )
    yield ControllerDaemon(config)


def serving(daemon: ControllerDaemon, calls: int) -> tuple[Slow, list[threading.Thread]]:
    slow = Slow(daemon._in_flight)
    daemon._server = slow.server
    threads = [slow.call() for _ in range(calls)]
    deadline = time.monotonic() + 10
    while daemon._in_flight.count < calls:
        assert time.monotonic() < deadline, "the calls never arrived"
        time.sleep(0.01)
    return slow, threads


def test_the_rpcs_the_grace_period_cut_short_are_counted(daemon: ControllerDaemon):
    slow, threads = serving(daemon, calls=2)
    assert daemon._stop_serving() == (2, 2)  # the grace (0.3 s) ended with both still waiting
    slow.release.set()
    for thread in threads:
        thread.join(10)


def test_rpcs_that_finish_within_the_grace_are_not_cut_short(daemon: ControllerDaemon):
    slow, threads = serving(daemon, calls=1)
    threading.Timer(0.1, slow.release.set).start()
    assert daemon._stop_serving() == (1, 0)
    threads[0].join(10)
    assert daemon._in_flight.count == 0


def test_a_second_ctrl_c_cancels_the_rpcs_at_once(daemon: ControllerDaemon):
    daemon.config = daemon.config.model_copy(update={"shutdown_grace_seconds": 30.0})
    slow, threads = serving(daemon, calls=1)
    threading.Timer(0.2, daemon.lifecycle.force_exit.set).start()
    started = time.monotonic()
    assert daemon._stop_serving() == (1, 1)
    assert time.monotonic() - started < 5
    slow.release.set()
    threads[0].join(10)


def test_the_count_goes_down_when_a_handler_raises():
    in_flight = InFlight()

    def intercepted(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        async def continuation(details: object) -> grpc.RpcMethodHandler:
            return handler

        details = SimpleNamespace(method=f"/t/{id(handler)}")
        return asyncio.run(in_flight.intercept_service(continuation, details))

    boom = intercepted(grpc.unary_unary_rpc_method_handler(lambda request, context: 1 / 0))
    with pytest.raises(ZeroDivisionError):
        boom.unary_unary(b"", None)
    assert in_flight.count == 0

    async def boom_on_loop(request: bytes, context: object) -> bytes:
        raise ZeroDivisionError

    with pytest.raises(ZeroDivisionError):
        asyncio.run(intercepted(grpc.unary_unary_rpc_method_handler(boom_on_loop)).unary_unary(b"", None))
    assert in_flight.count == 0
    stream = grpc.unary_stream_rpc_method_handler(lambda request, context: iter(()))
    assert intercepted(stream) is stream  # long-lived streams: not counted
