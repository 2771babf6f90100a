"""No unauthenticated client can take the controller's threads (issue 22): health Watch streams run without holding
a pool thread, so a crowd of them leaves Decide answering. A real daemon on a loopback socket."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.controller.test_service import DEFAULT_POLICY, connected, running_daemon

STREAMS = 120  # well past the daemon's pool (max_workers 4 + max_watchers)


def test_many_health_watch_streams_leave_decide_answering(embedded_redis_url, tmp_path) -> None:
    with running_daemon(embedded_redis_url, tmp_path, DEFAULT_POLICY.read_text(), max_watchers=8) as daemon:
        pass_through = _open_watches(daemon.address, STREAMS)
        try:
            with connected(daemon) as channel:
                stub = pb_grpc.ControllerStub(channel)
                request = pb.DecideRequest(segment="s", batch_size=1, drafters=["draft"], max_new_tokens=64)
                for _ in range(5):
                    assert stub.Decide(request, timeout=3.0).policy_version
        finally:
            pass_through()


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
