"""The controller's Prometheus endpoint (opt-in, ``metrics.listen``): ``GET /metrics`` over plain HTTP, serving the
learner's registry (the α drift series) and, read at scrape time, what GetSegmentStats shows of each segment.

- **One code path.** Each segment's figures are ``views.segment_stats(Controller.segment_view(...))``, the message
  GetSegmentStats and ListSegments answer with, so /metrics, the RPC and ``specd segments`` cannot disagree. Those
  views read the learner's in-memory snapshot, never Redis: while Redis is down a scrape answers from memory, as
  Decide does, and says so (``specd_controller_stale`` 1).
- **Bounded.** A scrape reads at most the store's segment cap (``max_segments`` plus ``_overflow``) and stops after
  ``metrics.max_scrape_seconds``; one scrape computes at a time. A segment that cannot be read, and a scrape cut
  short, add to ``specd_controller_metrics_scrape_errors_total`` and are logged; the rest is served (never a 500).
- **Beside gRPC, not on it.** The HTTP server has its own accept thread and at most ``MAX_CONNECTIONS`` connection
  threads, each with a socket timeout (more connections are closed at once): a scraper can hold neither a thread
  of Decide's pool nor an unbounded number of threads or descriptors (contract 10). The GIL is shared: that is why a
  scrape's work is bounded in time.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from controller.config import MetricsConfig
from controller.decision.core import Controller
from controller.serving.views import segment_stats
from specd_api.speedup import ratio
from specd_api.v1 import controller_pb2 as pb

log = logging.getLogger(__name__)

PATH = "/metrics"
MAX_CONNECTIONS = 4  # scrapes served at once; Prometheus sends one at a time per target
SOCKET_TIMEOUT_SECONDS = 10.0  # a connection that sends nothing for this long is closed
MIN_SHOWN_REQUESTS = 0.5  # a calibration measured by fewer (decayed) requests is not shown, as `specd segments`


# --- what a scrape exports ------------------------------------------------------------------------------------------


class SegmentFamilies:
    """The per-segment series of one scrape, filled from GetSegmentStats messages."""

    def __init__(self) -> None:
        by_drafter = ["segment", "drafter"]
        self.rounds = GaugeMetricFamily("specd_controller_segment_rounds", "rounds the segment's decayed counts hold",
                                        labels=["segment"])  # fmt: skip
        self.alpha = GaugeMetricFamily("specd_controller_alpha", "acceptance rate α (accepted / proposed) of the "
                                       "drafter's served rounds, over every K", labels=by_drafter)  # fmt: skip
        self.calibration = GaugeMetricFamily(
            "specd_controller_calibration", "realised / expected speedup, the median over the segment's recent "
            "requests (1.0: the speedup model came true)", labels=by_drafter,
        )  # fmt: skip
        self.calibration_requests = GaugeMetricFamily(
            "specd_controller_calibration_requests",
            "requests (decayed) that calibration is the median of",
            labels=by_drafter,
        )
        self.decision_k = GaugeMetricFamily(
            "specd_controller_decision_k", "the K ceiling Decide would give a typical request of the segment now (0: "
            "drafter none)", labels=by_drafter,
        )  # fmt: skip
        self.decision_speedup = GaugeMetricFamily(
            "specd_controller_decision_expected_speedup", "the expected speedup of that decision", labels=by_drafter
        )

    def add(self, stats: pb.SegmentStats) -> None:
        segment = stats.segment
        self.rounds.add_metric([segment], stats.rounds)
        for d in stats.drafters:
            proposed = sum(k.proposed for k in d.by_k)
            if proposed > 0:
                self.alpha.add_metric([segment, d.drafter], ratio(sum(k.accepted for k in d.by_k), proposed))
            if d.calibration_requests >= MIN_SHOWN_REQUESTS:
                self.calibration.add_metric([segment, d.drafter], d.calibration)
                self.calibration_requests.add_metric([segment, d.drafter], d.calibration_requests)
        decision = stats.decision
        self.decision_k.add_metric([segment, decision.drafter], decision.k)
        self.decision_speedup.add_metric([segment, decision.drafter], decision.expected_speedup)

    def families(self) -> list[Metric]:
        return [self.rounds, self.alpha, self.calibration, self.calibration_requests, self.decision_k,
                self.decision_speedup]  # fmt: skip


class SegmentCollector:
    """A Prometheus collector over the controller's segments, evaluated at scrape time (module docstring)."""

    def __init__(
        self,
        controller: Controller,
        max_segments: int,
        max_seconds: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.controller = controller
        self.max_segments = max_segments
        self.max_seconds = max_seconds
        self.clock = clock
        self.errors = 0  # segments that could not be read and scrapes cut short, since the start
        self._lock = threading.Lock()  # one scrape computes at a time

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            families = self._scrape()
        yield from families

    def _scrape(self) -> list[Metric]:
        start = self.clock()
        families = SegmentFamilies()
        segments: list[str] = []
        exported = 0
        try:
            segments = self.controller.learner.segments()
            for segment in segments[: self.max_segments]:
                if self.clock() - start > self.max_seconds:
                    self.errors += 1
                    log.warning("a metrics scrape stopped after %.1fs: %d of %d segments left out",
                                self.clock() - start, len(segments) - exported, len(segments))  # fmt: skip
                    break
                try:
                    stats = segment_stats(self.controller.segment_view(segment))
                except Exception as e:  # one segment's failure fails that segment's series only
                    self.errors += 1
                    log.warning("metrics: segment %s left out of the scrape: %s", segment, e)
                    continue
                families.add(stats)
                exported += 1
        except Exception as e:  # the segment list itself: the scrape still serves what follows
            self.errors += 1
            log.warning("metrics: the segments could not be listed: %s", e)
        return [*families.families(), *self._about(len(segments), exported, self.clock() - start)]

    def _about(self, segments: int, exported: int, seconds: float) -> Iterable[Metric]:
        """The controller's state and the scrape's own figures."""
        yield GaugeMetricFamily("specd_controller_segments", "segments the controller tracks", value=segments)
        yield GaugeMetricFamily("specd_controller_stale", "1 while Redis does not answer: decisions come from memory",
                                value=1.0 if self.controller.learner.stale else 0.0)  # fmt: skip
        yield GaugeMetricFamily("specd_controller_metrics_segments_left_out", "segments this scrape did not export "
                                "(past the cap or the time bound, unreadable)", value=segments - exported)  # fmt: skip
        yield GaugeMetricFamily("specd_controller_metrics_scrape_seconds", "how long this scrape's segments took",
                                value=seconds)  # fmt: skip
        yield CounterMetricFamily("specd_controller_metrics_scrape_errors", "segments a scrape could not read, and "
                                  "scrapes cut short by the time bound", value=self.errors)  # fmt: skip
        yield CounterMetricFamily("specd_controller_stored_entries_skipped", "stored entries a read of Redis could "
                                  "not use and skipped (a key of the wrong type, a row that is not a sample, a prior "
                                  "that is not one): counted at each read, each key logged once",
                                  value=self.controller.learner.store.skipped.count)  # fmt: skip


# --- the HTTP server ------------------------------------------------------------------------------------------------


class _QuietHandler(WSGIRequestHandler):
    timeout = SOCKET_TIMEOUT_SECONDS

    def log_message(self, format: str, *args: Any) -> None:
        """No access log: a scrape every 15 s would fill the journal."""


class _BoundedServer(WSGIServer):
    """wsgiref's server with a thread per connection, at most ``max_connections`` at once: a connection past them
    is closed at once (the scraper retries at its next interval)."""

    allow_reuse_port = False  # a second controller on the same port fails to start, as with gRPC

    def __init__(self, address: tuple[Any, ...], family: socket.AddressFamily, max_connections: int) -> None:
        self.address_family = family
        self._slots = threading.BoundedSemaphore(max_connections)
        super().__init__(address, _QuietHandler)

    def server_bind(self) -> None:
        """Bind, without HTTPServer's reverse DNS lookup of the host (seconds where DNS does not answer)."""
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])
        self.setup_environ()

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        threading.Thread(target=self._serve_one, args=(request, client_address), name="specd-metrics-scrape",
                         daemon=True).start()  # fmt: skip

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("metrics: a connection from %s failed", client_address, exc_info=True)


def metrics_app(registry: CollectorRegistry) -> Callable[..., Iterable[bytes]]:
    """prometheus_client's WSGI app on ``PATH`` only (it would answer any path)."""
    exposition = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != PATH:
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [f"not found: metrics are at {PATH}\n".encode()]
        return exposition(environ, start_response)

    return app


class MetricsServer:
    """The running endpoint: ``address`` is where it listens (the port chosen, for port 0); ``close`` stops it."""

    def __init__(self, server: _BoundedServer, thread: threading.Thread) -> None:
        self._server, self._thread = server, thread

    @property
    def address(self) -> str:
        host, port = self._server.server_name, self._server.server_port  # as bound (server_bind)
        return f"[{host}]:{port}" if self._server.address_family == socket.AF_INET6 else f"{host}:{port}"

    def close(self) -> None:
        """Stop accepting and close the socket; a scrape being answered finishes on its own daemon thread."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(host: str, port: int, registry: CollectorRegistry) -> MetricsServer:
    """Bind ``host:port`` (port 0: a free one) and serve ``registry`` at ``PATH`` from a thread of its own. Raises
    OSError when the address cannot be resolved or bound."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    server = _BoundedServer(address, family, MAX_CONNECTIONS)
    server.set_app(metrics_app(registry))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.25}, name="specd-metrics",
                              daemon=True)  # fmt: skip
    thread.start()
    return MetricsServer(server, thread)


def serve_metrics(controller: Controller, config: MetricsConfig, max_segments: int) -> MetricsServer:
    """The controller's endpoint: its segments' collector added to the learner's registry, served on
    ``config.listen``. Raises OSError when that address cannot be bound."""
    registry = controller.learner.registry
    registry.register(SegmentCollector(controller, max_segments, config.max_scrape_seconds))
    return start_metrics_server(config.host, config.port, registry)
