"""The health service with a bound on its Watch streams.

``grpc.health.v1.Health/Watch`` needs no token (load balancers and probes call it), and each stream holds about 20 KiB
for as long as its client likes: 10,000 of them from one client without a token would grow the controller by 200 MB, and
gRPC does not bound how many. Here at most ``MAX_HEALTH_STREAMS`` are open at once, ``MAX_HEALTH_STREAMS_PER_HOST`` of
them from one client host (a balancer or a worker keeps one per connection); a stream past either is refused with
RESOURCE_EXHAUSTED, naming the bound, before it holds anything. ``Check`` is not bounded (it holds nothing once
answered). The counts are touched only by coroutines on the server's one event loop: no lock.
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from controller.serving.report_budget import peer_host
from specd_api.host_counts import HostCounts

MAX_HEALTH_STREAMS = 1024
MAX_HEALTH_STREAMS_PER_HOST = 64


class BoundedHealth(health.aio.HealthServicer):
    """grpc_health's asyncio servicer (a Watch stream waits on the loop, never in a thread), its Watch streams
    bounded in all and per client host."""

    def __init__(self, max_streams: int = MAX_HEALTH_STREAMS, per_host: int = MAX_HEALTH_STREAMS_PER_HOST) -> None:
        super().__init__()
        self.max_streams, self.per_host = max_streams, per_host
        self.open = HostCounts()  # the Watch streams open, by client host

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        host = peer_host(context.peer())
        mine = self.open.of(host)
        if self.open.total >= self.max_streams:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_streams} health Watch streams are "
                                "open (MAX_HEALTH_STREAMS): use Check, or close one")  # fmt: skip
        if mine >= self.per_host:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{host} has {mine} health Watch streams open "
                                "(MAX_HEALTH_STREAMS_PER_HOST): use Check, or close one")  # fmt: skip
        self.open.add(host)
        try:
            await super().Watch(request, context)
        finally:
            self.open.remove(host)
