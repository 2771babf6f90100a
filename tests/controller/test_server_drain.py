"""What the controller daemon's drain counts (controller/server.py): the RPCs in flight, the ones the grace period
cut short, and a second Ctrl-C cancelling them at once. A real gRPC server whose one method blocks until told."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest

from controller.config import ControllerConfig
from controller.server import ControllerDaemon, InFlight

METHOD = "/test.Slow/Wait"


class Slow:
    """A server with InFlight and one unary method that waits for ``release`` (or 10 s)."""

    def __init__(self, in_flight: InFlight) -> None:
        self.release = threading.Event()
        handler = grpc.unary_unary_rpc_method_handler(self._wait)
        generic = grpc.method_handlers_generic_handler("test.Slow", {"Wait": handler})
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[in_flight])
        self.server.add_generic_rpc_handlers((generic,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
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
    boom = grpc.unary_unary_rpc_method_handler(lambda request, context: 1 / 0)
    wrapped = in_flight.intercept_service(lambda details: boom, None)
    with pytest.raises(ZeroDivisionError):
        wrapped.unary_unary(b"", None)
    assert in_flight.count == 0
    stream = grpc.unary_stream_rpc_method_handler(lambda request, context: iter(()))
    assert in_flight.intercept_service(lambda details: stream, None) is stream  # long-lived streams: not counted
