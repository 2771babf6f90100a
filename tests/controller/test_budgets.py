"""No client can take the controller's threads: health Watch streams and calls that send their headers
and never a message run without holding a pool thread, so a crowd of them leaves Decide answering. Real daemons on
loopback sockets: in this process, and a `specd controller` process with the default pool."""

from __future__ import annotations

import os
import signal
import time
from contextlib import ExitStack
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from controller.serving.health_streams import MAX_HEALTH_STREAMS_PER_HOST
from controller.serving.request_wait import MAX_WAITING_CALLS_PER_HOST
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.controller.half_open import HalfOpenCalls
from tests.controller.test_daemon import start, write_tokened_config
from tests.daemons import DEFAULT_POLICY, connected, running_daemon
from tests.waiting import wait_until

HALF_OPEN = 300  # per kind of caller: more calls than the default pool holds (max_workers 16 + max_watchers 256)
DECIDE = "/specd.v1.Controller/Decide"
REPORT = "/specd.v1.Controller/ReportRounds"


def test_many_health_watch_streams_leave_decide_answering(embedded_redis_url, tmp_path) -> None:
    with running_daemon(embedded_redis_url, tmp_path, DEFAULT_POLICY.read_text(), max_watchers=8) as daemon:
        # one host's share of health Watch streams (serving/health_streams.py), well past the pool (24 threads)
        pass_through = _open_watches(daemon.address, MAX_HEALTH_STREAMS_PER_HOST)
        try:
            with connected(daemon) as channel:
                stub = pb_grpc.ControllerStub(channel)
                request = pb.DecideRequest(segment="s", batch_size=1, drafters=["draft"], max_new_tokens=64)
                for _ in range(5):
                    assert stub.Decide(request, timeout=3.0).policy_version
        finally:
            pass_through()


def test_watch_decisions_streams_give_their_thread_back_when_the_client_goes(embedded_redis_url, tmp_path) -> None:
    """Five times as many WatchDecisions streams as the pool has threads, each cancelled after its first message:
    every one ends (the publisher counts no watcher), and a new stream and Decide still answer. grpc.aio's own way
    of serving a synchronous stream held a thread for good once its client had gone."""
    with running_daemon(embedded_redis_url, tmp_path, DEFAULT_POLICY.read_text(), max_watchers=4) as daemon:
        assert daemon.publisher is not None
        pool = daemon.config.max_workers + daemon.config.max_watchers
        with connected(daemon) as channel:
            stub = pb_grpc.ControllerStub(channel)
            watch = pb.WatchDecisionsRequest(worker_id="w", drafters=["draft"])
            for _ in range(5 * pool // 4):
                streams = [stub.WatchDecisions(watch, timeout=10) for _ in range(4)]
                for stream in streams:
                    assert next(stream).full
                for stream in streams:
                    stream.cancel()
                wait_until(lambda: daemon.publisher.watchers == 0, what="the cancelled streams ending")
            assert next(stub.WatchDecisions(watch, timeout=5)).full
            request = pb.DecideRequest(segment="s", batch_size=1, drafters=["draft"], max_new_tokens=64)
            assert stub.Decide(request, timeout=3.0).policy_version


def _open_watches(address: str, count: int):
    """``count`` Watch streams, each past its first answer and left open; returns a function that closes them."""
    channel = grpc.insecure_channel(address)
    stub = health_pb2_grpc.HealthStub(channel)
    calls = []
    for _ in range(count):
        call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        calls.append(call)
    for call in calls[:3]:
        next(call)  # the server answered these: the streams are live

    def close() -> None:
        for call in calls:
            call.cancel()
        channel.close()

    return close


def test_a_report_is_bounded_in_positions_and_bytes(embedded_redis_url, tmp_path) -> None:
    import grpc as g
    import pytest

    from specd_api.checks import MAX_REPORT_BYTES, MAX_REPORT_POSITIONS
    from tests.controller.test_service import draft_aggregate

    with running_daemon(embedded_redis_url, tmp_path, DEFAULT_POLICY.read_text()) as daemon, connected(daemon) as ch:
        stub = pb_grpc.ControllerStub(ch)
        wide = draft_aggregate("wide", k=64, proposed_per_position=[10] * 64, num_drafted=640,
                               verified_per_position=[10, 8], accepted_per_position=[8, 4])  # fmt: skip
        count = MAX_REPORT_POSITIONS // 64 + 1
        with pytest.raises(g.RpcError) as refused:
            stub.ReportRounds(pb.ReportRoundsRequest(report_id="wide", worker_id="w", aggregates=[wide] * count),
                              timeout=10)  # fmt: skip
        assert refused.value.code() == g.StatusCode.INVALID_ARGUMENT and "draft positions" in refused.value.details()
        huge = pb.ReportRoundsRequest(report_id="huge", worker_id="w" * (MAX_REPORT_BYTES + 1))
        with pytest.raises(g.RpcError) as too_big:
            stub.ReportRounds(huge, timeout=10)
        assert too_big.value.code() == g.StatusCode.RESOURCE_EXHAUSTED
        fine = pb.ReportRoundsRequest(report_id="fine", worker_id="w", aggregates=[draft_aggregate("fine")] * 500)
        assert stub.ReportRounds(fine, timeout=10).rounds_accepted == 5000


def test_calls_that_never_send_a_message_hold_no_thread(tmp_path: Path, embedded_redis_url: str) -> None:
    """300 calls each with no token, a wrong token and the read token, each sending its headers and never a message
    (raw HTTP/2, as a hostile client would): Decide from another client still answers within its deadline, the
    process's thread count does not grow with them (the synchronous server gave each a pool thread, and about 270
    timed every Decide out), the unauthenticated ones are refused at once, and SIGTERM still drains within the
    grace."""
    config, port, tokens = write_tokened_config(tmp_path, embedded_redis_url)
    read = tokens["T_READ"]
    process = start(config, {**tokens, "SPECD_REQUEST_WAIT_SECONDS": "60"})  # the waiting calls outlast the test
    address = f"127.0.0.1:{port}"
    try:
        with ExitStack() as stack:
            channel = stack.enter_context(grpc.insecure_channel(address))
            decide = pb_grpc.ControllerStub(channel).Decide
            request = pb.DecideRequest(segment="s", batch_size=1, drafters=["draft"], max_new_tokens=64)
            metadata = (("authorization", f"Bearer {read}"),)
            wait_until(lambda: _answers(decide, request, metadata), timeout=60, what="the controller answering")
            threads = _threads(process.pid)
            unauthenticated = [
                stack.enter_context(HalfOpenCalls(address, DECIDE, HALF_OPEN)),
                stack.enter_context(HalfOpenCalls(address, REPORT, HALF_OPEN, token="wrong-token")),
            ]
            waiting = stack.enter_context(HalfOpenCalls(address, DECIDE, HALF_OPEN, token=read))  # fmt: skip
            time.sleep(1.0)  # every call has reached the server: they take a synchronous server's pool within 0.1 s

            for _ in range(5):
                assert decide(request, metadata=metadata, timeout=2.0).policy_version
            assert _threads(process.pid) < threads + 16, "half-open calls took threads"
            wait_until(lambda: sum(c.ended_by_server for c in unauthenticated) == 2 * HALF_OPEN, timeout=10,
                       what="every call without a valid token refused at once")  # fmt: skip
            # still waiting for their messages, threadless: the host's share of them (MAX_WAITING_CALLS_PER_HOST);
            # those past it were refused after OVER_CAP_WAIT_SECONDS
            wait_until(lambda: waiting.ended_by_server == HALF_OPEN - MAX_WAITING_CALLS_PER_HOST, timeout=5,
                       what="the read-token calls past the host's share refused")  # fmt: skip
            time.sleep(0.5)
            assert waiting.ended_by_server == HALF_OPEN - MAX_WAITING_CALLS_PER_HOST

            started = time.monotonic()
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
            assert time.monotonic() - started < 10  # the grace (1 s) cancelled the waiting calls
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    assert "Traceback" not in output, output


def _answers(decide, request: pb.DecideRequest, metadata) -> bool:
    try:
        return bool(decide(request, metadata=metadata, timeout=2.0).policy_version)
    except grpc.RpcError:
        return False


def _threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))
