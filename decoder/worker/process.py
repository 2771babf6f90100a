"""The worker process's lifecycle (specd_api.lifecycle): startup (models, decode thread, controller client,
tracing, the listening socket) -> main loop (uvicorn serves the API) -> shutdown.

On SIGTERM/SIGINT uvicorn stops accepting and waits for the open connections while the service drains: the
admitted requests finish within ``shutdown_grace_seconds`` (the rest are cancelled), then telemetry is flushed to
the controller and spans to the exporter. The lifecycle owns the signal handlers; uvicorn installs none, so it
never re-raises the signal after its own graceful stop (that would kill the worker before its drain and flush).

If the decode loop dies, nothing can decode any more: the worker stops as on SIGTERM and exits 1, so that systemd
(Restart=on-failure) restarts it; /health says 503 meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn

from decoder.worker.app import build_app
from decoder.worker.config import WorkerConfig, split_address
from decoder.worker.connections import uvicorn_options
from decoder.worker.service import WorkerService
from specd_api.errors import UsageError
from specd_api.lifecycle import Drain, Lifecycle, freeze_startup_heap

log = logging.getLogger("specd.worker")


class LifecycleServer(uvicorn.Server):
    """uvicorn's Server whose exit flags are the process lifecycle's: it installs no signal handlers of its own and
    sees a signal that came before it started. On the way out ``drain`` runs in a thread while uvicorn stops
    accepting and waits for the open connections; both end before the event loop closes."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain: Callable[[], None] = lambda: None) -> None:
        self.lifecycle, self.drain = lifecycle, drain
        super().__init__(config)

    @property
    def should_exit(self) -> bool:
        return self.lifecycle.should_exit.is_set()

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        if value:
            self.lifecycle.request_exit()

    @property
    def force_exit(self) -> bool:
        return self.lifecycle.force_exit.is_set()

    @force_exit.setter
    def force_exit(self, value: bool) -> None:
        if value:
            self.lifecycle.force_exit.set()

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the lifecycle installed the handlers around the whole run

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drained = asyncio.ensure_future(asyncio.to_thread(self.drain))
        try:
            await super().shutdown(sockets=sockets)
        finally:
            await drained


@dataclass(frozen=True)
class Tally:
    """Requests by outcome and telemetry counts, read twice to tell what a drain did."""

    in_flight: int
    requests: dict[str, float]  # specd_requests_total by status
    aggregates_sent: int
    aggregates_dropped: int

    @staticmethod
    def of(service: WorkerService) -> Tally:
        requests: dict[str, float] = {}
        for family in service.metrics.requests.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    status = sample.labels["status"]
                    requests[status] = requests.get(status, 0.0) + sample.value
        scheduler, client = service.scheduler, service.client
        stats = client.stats() if client is not None else None
        return Tally(
            in_flight=scheduler.batch_size + scheduler.queue_depth if scheduler is not None else 0,
            requests=requests,
            aggregates_sent=stats.aggregates_sent if stats else 0,
            aggregates_dropped=stats.aggregates_dropped if stats else 0,
        )

    def drain_since(self, before: Tally, forced: bool) -> Drain:
        def delta(status: str) -> int:
            return int(self.requests.get(status, 0.0) - before.requests.get(status, 0.0))

        ended = sum(delta(status) for status in self.requests)
        return Drain(
            finished={
                "requests finished": ended - delta("cancelled"),
                "telemetry aggregates sent": self.aggregates_sent - before.aggregates_sent,
            },
            cut_short={
                "requests cancelled": delta("cancelled"),
                "telemetry aggregates dropped": self.aggregates_dropped - before.aggregates_dropped,
            },
            forced=forced,
        )


class WorkerProcess:
    """``specd worker`` as a ``specd_api.lifecycle.Server``."""

    def __init__(self, cfg: WorkerConfig, log_level: str) -> None:
        self.cfg, self.log_level = cfg, log_level
        self.lifecycle = Lifecycle()
        self.service = WorkerService(cfg, on_failure=self._decode_loop_failed)
        self._socket: socket.socket | None = None
        self._at_stop: Tally | None = None  # what was in flight when the drain began

    @property
    def exit_status(self) -> int:
        scheduler = self.service.scheduler
        return 0 if scheduler is None or scheduler.failure is None else 1

    def startup(self) -> None:
        self.service.startup(worker_id=self.cfg.listen)
        freeze_startup_heap()  # the models, the tokenizer, the modules: a full collection walked them for 0.2 s
        self._socket = bind(self.cfg.listen)
        host, port = self._socket.getsockname()[:2]
        host = f"[{host}]" if ":" in host else host  # an IPv6 address, as a URL writes it
        engine = self.service.engine
        drafters = ", ".join(engine.drafters) if engine else ""
        step = engine.target_pool.forward_pass if engine else None
        forward = f"the {step.name} pass ({step.kernel} products) in {step.dtype_name}, " if step else ""
        print(  # tests and the demo wait for this line; connections queue in the backlog until uvicorn accepts
            f"specd worker listening on http://{host}:{port} (model {self.cfg.model_name}, drafters {drafters}, "
            f"{forward}controller {self.cfg.controller.address or 'none'})",
            flush=True,
        )

    def main_loop(self) -> None:
        assert self._socket is not None
        options = uvicorn_options(self.cfg.limits)
        config = uvicorn.Config(
            build_app(self.service),
            log_level=self.log_level.lower(),
            access_log=False,
            # A backstop: the service's drain ends every request within the grace, so uvicorn cancels only a
            # connection still open a second later (a client not reading its stream). Whole seconds (uvicorn's
            # type), rounded up: ``int(grace) or None`` would let a grace under 1 s wait forever.
            timeout_graceful_shutdown=math.ceil(self.cfg.shutdown_grace_seconds) + 1,
            lifespan="off",
            **options,
        )
        LifecycleServer(config, self.lifecycle, drain=self._drain).run(sockets=[self._socket])
        options["http"].sparse.flush()  # the connections closed at the stop, counted in one line

    def shutdown(self) -> Drain:
        if self._at_stop is None:  # uvicorn never ran (a failed start-up, or a signal during it)
            self._drain()
        if self._socket is not None:
            self._socket.close()  # uvicorn closed it already, unless it never ran
        assert self._at_stop is not None
        return Tally.of(self.service).drain_since(self._at_stop, self.lifecycle.force_exit.is_set())

    def _decode_loop_failed(self, error: BaseException) -> None:
        """On the decode thread, as it dies: stop serving (a flag, as a signal would), to exit 1."""
        log.error("the decode loop failed (%r): stopping, to exit 1 and be restarted", error)
        self.lifecycle.request_exit()

    def _drain(self) -> None:
        """Finish the admitted requests within the grace period (the rest are cancelled: their responses end with
        an error), then flush telemetry and spans. Runs while uvicorn's event loop is open: the decode thread
        posts each request's last events to it (a loop closed under it would crash the decode thread)."""
        self._at_stop = Tally.of(self.service)
        if self._at_stop.in_flight:
            log.warning("stopping: %d requests in flight get up to %gs", self._at_stop.in_flight,
                        self.cfg.shutdown_grace_seconds)  # fmt: skip
        self.service.shutdown()


def bind(listen: str) -> socket.socket:
    """A listening socket on ``host:port`` (port 0 picks a free one; ``[::]`` takes IPv4 clients too)."""
    host, port = split_address(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    both = host == "::" and socket.has_dualstack_ipv6()  # every address: IPv4 clients too, as ::ffff:a.b.c.d
    try:
        return socket.create_server((host, port), family=family, backlog=2048, dualstack_ipv6=both)
    except OSError as e:
        raise UsageError(f"cannot listen on {listen}: {e.strerror or e}") from None
