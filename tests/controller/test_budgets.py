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
