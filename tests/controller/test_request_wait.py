"""A call's request has a deadline, and the calls waiting for theirs a cap (serving/request_wait.py).

One `specd controller` process with tokens, a request deadline of ``WAIT_S`` and a cap of ``CAP`` waiting calls (the
environment sets both; the defaults are 10 s and 1,000): calls that send their headers and never a message (over raw
HTTP/2, and from grpc.aio's client, which shows the status) are ended by the server once the deadline passes; past
the cap a new one is refused with RESOURCE_EXHAUSTED within 0.1 s (OVER_CAP_WAIT_SECONDS) while Decide and
ReportRounds answer; a call with no message or two is INVALID_ARGUMENT; streams past their request are not cut short
by the deadline."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from subprocess import Popen

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controller.serving.request_wait import (
    MAX_WAITING_CALLS,
    MAX_WAITING_CALLS_PER_HOST,
    REQUEST_WAIT_SECONDS,
    RequestWait,
    WaitLimits,
)
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.controller.half_open import HalfOpenCalls
from tests.controller.test_daemon import start, write_tokened_config
from tests.controller.test_interceptors import intercept, unary
from tests.controller.test_service import draft_aggregate
from tests.daemons import ipv6_loopback
from tests.waiting import wait_until

WAIT_S = 1.5
CAP = 40
DECIDE = "/specd.v1.Controller/Decide"
HEALTH_CHECK, HEALTH_WATCH = "/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch"
REQUEST = pb.DecideRequest(segment="request-wait", batch_size=1, drafters=["draft"], max_new_tokens=64)


@dataclass(frozen=True)
class Controller:
    address: str
    read: str  # the read token
    write: str
    process: Popen[str]

    def metadata(self, token: str | None = None) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {token or self.read}"),)


@pytest.fixture(scope="module")
def controller(embedded_redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controller]:
    folder = tmp_path_factory.mktemp("request-wait")
    config, port, tokens = write_tokened_config(folder, embedded_redis_url)
    read, write = tokens["T_READ"], tokens["T_WRITE"]
    env = {**tokens, "SPECD_REQUEST_WAIT_SECONDS": str(WAIT_S), "SPECD_MAX_WAITING_CALLS": str(CAP)}
    process = start(config, env)
    running = Controller(f"127.0.0.1:{port}", read, write, process)
    try:
        with grpc.insecure_channel(running.address) as channel:
            decide = pb_grpc.ControllerStub(channel).Decide
            wait_until(lambda: _answers(decide, running), timeout=60, what="the controller answering")
        yield running
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=30)
        output = process.communicate()[0]
    assert "Traceback" not in output and "Unexpected" not in output, output


def test_calls_whose_request_never_comes_end_at_the_deadline_and_streams_do_not(controller: Controller) -> None:
    """Half-open calls with the read token (Decide) and without one (health Watch, open to all) wait, threadless,
    then the server ends every one of them soon after ``WAIT_S``; grpc.aio's client sees DEADLINE_EXCEEDED naming
    the bound. A WatchDecisions and a health Watch stream whose request came stay open past the deadline."""
    with grpc.insecure_channel(controller.address) as channel:
        watch = pb_grpc.ControllerStub(channel).WatchDecisions(
            pb.WatchDecisionsRequest(worker_id="w", drafters=["draft"]), metadata=controller.metadata(), timeout=30
        )
        health = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=30)
        assert next(watch).full and next(health).status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        with HalfOpenCalls(controller.address, DECIDE, 10, token=controller.read) as decides, \
                HalfOpenCalls(controller.address, HEALTH_WATCH, 10) as watches:  # fmt: skip
            time.sleep(WAIT_S / 2)
            assert decides.ended_by_server == 0 and watches.ended_by_server == 0  # they wait
            silent = asyncio.run(_call_status(controller, DECIDE, messages=None))
            wait_until(lambda: decides.ended_by_server == watches.ended_by_server == 10, timeout=WAIT_S + 5,
                       what="the server ending every half-open call")  # fmt: skip
        code, details, seconds = silent
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and "REQUEST_WAIT_SECONDS" in details, details
        assert WAIT_S - 0.2 < seconds < WAIT_S + 3
        assert time.monotonic() - started > WAIT_S
        assert watch.is_active() and health.is_active(), "a stream past its request was ended"
        assert _answers(pb_grpc.ControllerStub(channel).Decide, controller)
        watch.cancel()
        health.cancel()


def test_past_the_cap_a_new_waiting_call_is_refused_at_once_and_decide_answers(controller: Controller) -> None:
    """``CAP`` half-open calls take every place; a further one is refused with RESOURCE_EXHAUSTED after
    OVER_CAP_WAIT_SECONDS, well before the deadline, while Decide and ReportRounds from a normal client answer (their
    request comes with the headers). Once the server has ended the waiting calls, a new one waits again."""
    with HalfOpenCalls(controller.address, DECIDE, CAP, token=controller.read) as waiting:
        time.sleep(0.3)  # every call has reached the server and waits
        code, details, seconds = asyncio.run(_call_status(controller, DECIDE, messages=None))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "MAX_WAITING_CALLS" in details, details
        assert seconds < WAIT_S / 2
        with grpc.insecure_channel(controller.address) as channel:
            stub = pb_grpc.ControllerStub(channel)
            for _ in range(5):
                assert stub.Decide(REQUEST, metadata=controller.metadata(), timeout=2).policy_version
            report = pb.ReportRoundsRequest(report_id=secrets.token_hex(8), worker_id="w",
                                            aggregates=[draft_aggregate("request-wait")])  # fmt: skip
            assert stub.ReportRounds(report, metadata=controller.metadata(controller.write), timeout=2).rounds_accepted
        assert waiting.ended_by_server == 0
        wait_until(lambda: waiting.ended_by_server == CAP, timeout=WAIT_S + 5, what="the waiting calls ended")
    code, _, seconds = asyncio.run(_call_status(controller, DECIDE, messages=None, timeout=0.5))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and seconds >= 0.45  # the client's own deadline: it waited


def test_one_hosts_waiting_calls_leave_another_hosts_their_full_wait(embedded_redis_url: str, tmp_path) -> None:
    """A host's share of the waiting calls (MAX_WAITING_CALLS_PER_HOST): 30 health checks that never send their
    message from 127.0.0.1 (no token needed) against a share of 10 and a cap of 40 take 10 places; the other 20, and
    a further call from that host, are refused within OVER_CAP_WAIT_SECONDS naming the share, while a call from ::1
    still gets its whole wait (the client's own 1 s deadline ends it first). Without the share, one host's 1,500
    waiting health checks would leave a report crossing a slow link from another host 0.1 s, and refuse it."""
    if not ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine: the test needs calls from two hosts (127.0.0.1 and ::1)")
    config, port, tokens = write_tokened_config(tmp_path, embedded_redis_url)
    config.write_text(config.read_text().replace(f"listen: 127.0.0.1:{port}", f"listen: localhost:{port}"))
    env = {**tokens, "SPECD_REQUEST_WAIT_SECONDS": "60", "SPECD_MAX_WAITING_CALLS": "40",
           "SPECD_MAX_WAITING_CALLS_PER_HOST": "10"}  # fmt: skip
    process = start(config, env)
    v4 = Controller(f"127.0.0.1:{port}", tokens["T_READ"], tokens["T_WRITE"], process)
    v6 = Controller(f"[::1]:{port}", tokens["T_READ"], tokens["T_WRITE"], process)
    try:
        with grpc.insecure_channel(v4.address) as channel:
            decide = pb_grpc.ControllerStub(channel).Decide
            wait_until(lambda: _answers(decide, v4), timeout=60, what="the controller answering")
        with HalfOpenCalls(v4.address, HEALTH_CHECK, 30) as flood:
            wait_until(lambda: flood.ended_by_server == 20, timeout=3, what="the calls past the host's share ended")
            code, details, seconds = asyncio.run(_call_status(v4, DECIDE, messages=None))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "MAX_WAITING_CALLS_PER_HOST" in details, details
            assert seconds < 1.0
            code, _, seconds = asyncio.run(_call_status(v6, DECIDE, messages=None, timeout=1.0))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED and seconds >= 0.95, (code, seconds)  # it waited
            assert flood.ended_by_server == 20  # the host's 10 still wait
        # the flood gone, its places are given back: the host's own next call waits again (its client's deadline)
        deadline = time.monotonic() + 10
        while True:
            code, _, seconds = asyncio.run(_call_status(v4, DECIDE, messages=None, timeout=1.0))
            if code == grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED and seconds >= 0.95, (code, seconds)
    finally:
        process.terminate()
        process.wait(timeout=30)
        output = process.communicate()[0]
    assert "Traceback" not in output, output


@pytest.mark.parametrize("method", [DECIDE, HEALTH_CHECK])
def test_a_unary_call_takes_exactly_one_message(controller: Controller, method: str) -> None:
    """No message before the end of the request stream, or two: INVALID_ARGUMENT at once, never INTERNAL or
    UNKNOWN; exactly one is answered."""
    for messages in (0, 2):
        code, details, seconds = asyncio.run(_call_status(controller, method, messages))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "takes one" in details, (messages, details)
        assert seconds < WAIT_S / 2
    assert asyncio.run(_call_status(controller, method, 1))[0] == grpc.StatusCode.OK


def test_the_bounds_come_from_the_environment_once_and_are_checked() -> None:
    assert WaitLimits.from_environment({}) == WaitLimits(REQUEST_WAIT_SECONDS, MAX_WAITING_CALLS,
                                                         MAX_WAITING_CALLS_PER_HOST)  # fmt: skip
    assert WaitLimits.from_environment({"SPECD_REQUEST_WAIT_SECONDS": "2.5", "SPECD_MAX_WAITING_CALLS": "7"}) == \
        WaitLimits(2.5, 7)  # fmt: skip
    for bad in ({"SPECD_REQUEST_WAIT_SECONDS": "0"}, {"SPECD_REQUEST_WAIT_SECONDS": "nan"},
                {"SPECD_REQUEST_WAIT_SECONDS": "soon"}, {"SPECD_MAX_WAITING_CALLS": "0"},
                {"SPECD_MAX_WAITING_CALLS": "1.5"}):  # fmt: skip
        with pytest.raises(ValueError, match=next(iter(bad))):
            WaitLimits.from_environment(bad)


def test_the_interceptor_wraps_a_method_once() -> None:
    wait = RequestWait(WaitLimits())
    with futures.ThreadPoolExecutor(1) as pool:
        wait.serve_in(pool)
        handler = unary()
        first, _ = intercept(wait, handler, DECIDE)
        assert first.request_streaming and not first.response_streaming  # read by its own coroutine
        assert intercept(wait, handler, DECIDE)[0] is first
        assert intercept(wait, None, "/made/Up")[0] is None


async def _call_status(
    controller: Controller, method: str, messages: int | None, timeout: float = 10.0
) -> tuple[grpc.StatusCode, str, float]:
    """A call to ``method`` as a request stream: ``messages`` requests then the end of the stream, or (None) the
    headers alone. Returns its status, details and seconds."""
    request = REQUEST.SerializeToString() if method == DECIDE else health_pb2.HealthCheckRequest().SerializeToString()
    async with grpc.aio.insecure_channel(controller.address) as channel:
        call = channel.stream_unary(method)(metadata=controller.metadata(), timeout=timeout)
        started = time.monotonic()
        try:
            for _ in range(messages or 0):
                await call.write(request)
            if messages is not None:
                await call.done_writing()
            await call
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or "", time.monotonic() - started
        return grpc.StatusCode.OK, "", time.monotonic() - started


def _answers(decide: grpc.UnaryUnaryMultiCallable, controller: Controller) -> bool:
    try:
        return bool(decide(REQUEST, metadata=controller.metadata(), timeout=2.0).policy_version)
    except grpc.RpcError:
        return False
