"""The controller daemon's lifecycle, in plain sight: run -> startup -> main_loop -> shutdown (specd_api.lifecycle).

SIGTERM and SIGINT drain gracefully (a second SIGINT stops waiting for the RPCs in flight); SIGHUP reloads the
policy. systemd is told READY, RELOADING, STOPPING and pinged for the watchdog through NOTIFY_SOCKET when it is set.
The drain is logged: the RPCs it finished or cut short, and the reports still only in the journal. With
``metrics.listen`` set, GET /metrics is served beside gRPC (serving/metrics_endpoint.py), started before the gRPC
port and stopped after it. gRPC is served by grpc.aio on an event loop of its own (serving/grpc_server.py), so
that a call waiting for its request holds no thread; the servicer stays synchronous, run in a bounded pool.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import Counter as PrometheusCounter

from controller.config import ControllerConfig
from controller.decision.core import Controller
from controller.decision.learner import Learner
from controller.decision.policy import PolicyStore, load_policy
from controller.service import ControllerServicer
from controller.serving.auth import TokenCheck, Tokens, exposure_warnings, is_loopback, server_credentials
from controller.serving.grpc_server import GrpcServer, InFlight, ServerClosed
from controller.serving.health_streams import BoundedHealth
from controller.serving.host_share import HostShares
from controller.serving.metrics_endpoint import MetricsServer, serve_metrics
from controller.serving.report_head import METHOD as REPORT_ROUNDS
from controller.serving.report_head import ReceivedReport
from controller.serving.report_process import ReportProcess, StoreSpec
from controller.serving.request_wait import RequestWait, WaitLimits
from controller.serving.systemd import Notifier, WatchdogPinger
from controller.serving.table_publisher import DecisionPublisher
from controller.serving.unparsable import RefuseUndecodable
from controller.storage.journal import Journal
from controller.storage.redis_conn import RedisHandle, connect, redact
from controller.storage.store import TelemetryStore
from specd_api.checks import MAX_REPORT_BYTES
from specd_api.errors import SpecdError
from specd_api.lifecycle import Drain, Lifecycle, freeze_startup_heap, serve
from specd_api.tracing import make_exporter, make_provider, no_tracer
from specd_api.v1 import controller_pb2, controller_pb2_grpc
from specd_api.yaml_config import ConfigError

log = logging.getLogger("specd.controller")
WATCH_DECISIONS = "/specd.v1.Controller/WatchDecisions"
DECIDE = "/specd.v1.Controller/Decide"
# Decide is served on the event loop, in the thread that read its request: it reads memory only (contract 3), under
# locks never held across I/O or long work (the learner's, the caches'), in tens of microseconds. A hop to the pool
# and back would be two waits for the interpreter, each as long as whatever else held it: a report being summed, a
# burst of streams opening.
ON_LOOP = frozenset({DECIDE})
SWITCH_INTERVAL_S = 0.001  # the interpreter's switch interval in the daemon (Python's default: 5 ms)
SERVICE_NAME = controller_pb2.DESCRIPTOR.services_by_name["Controller"].full_name
# Health of the telemetry store alone: NOT_SERVING while Redis does not answer. "" and SERVICE_NAME stay SERVING
# then, since Decide keeps answering from memory (contract 3): a probe on them must not take every replica out of
# rotation because their shared Redis is down. Alert on this one instead.
REDIS_HEALTH = "specd.redis"


class StartupError(SpecdError):
    """The daemon cannot start (bad policy, port in use, Redis unusable)."""


class ControllerDaemon:
    def __init__(self, config: ControllerConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.lifecycle = Lifecycle(reload_signals=(signal.SIGHUP,))
        self.notifier = Notifier.from_environment()
        self.port: int | None = None
        self.controller: Controller | None = None
        self.publisher: DecisionPublisher | None = None
        self.reports: ReportProcess | None = None  # the child process reports are stored in (report_process.py)
        self.metrics: MetricsServer | None = None  # GET /metrics, when metrics.listen is set
        self._in_flight = InFlight()
        self.shares: HostShares | None = None  # each client host's turns in the handler pool, once serving
        self._redis: RedisHandle | None = None
        self._server: GrpcServer | None = None
        self._health: BoundedHealth | None = None
        self._threads: list[threading.Thread] = []
        self._provider: Any = None
        self._watchdog: WatchdogPinger | None = None
        self._redis_reachable = False  # what the REDIS_HEALTH status says; the refresh loop updates it

    # --- lifecycle ----------------------------------------------------------------------------------

    def run(self) -> int:
        serve(self, log)
        return 0

    def startup(self) -> None:
        """1. the policy (refused if invalid); 2. Redis (an embedded one supervised), the journal, the prior and the
        learner's first snapshot; 3. tracing; 4. the metrics endpoint (when asked for), then the gRPC server; 5. the
        background loops (the refresh starts at once and replays what the journal holds, so a large journal never
        delays listening; the prior's refits have a loop of their own, as they take seconds) and the watchdog; 6.
        READY."""
        policies = self._load_policy()
        learner = self._open_learning()
        config = self.config
        self.controller = Controller(
            learner, policies, max_remembered=config.learning.max_segments * 2, drafter_sets=config.max_drafter_sets
        )
        refresh = config.learning.refresh_seconds
        self.publisher = DecisionPublisher(
            self.controller, refresh, config.max_watchers, self.clock, config.max_watchers_per_host,
            config.max_drafter_sets, config.max_drafter_sets_per_host,
        )  # fmt: skip
        freeze_startup_heap()  # the modules, the policy, the prior, the first snapshot
        # A thread that wants the interpreter waits for the running one to give it up, or for the switch interval:
        # beside a report's unpaced stretches (its Redis command built, its samples encoded: milliseconds each) a
        # Decide would wait up to 5 ms (the default) at each of its thread crossings. 1 ms bounds each wait.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._serve_metrics()
        budget = (
            self.config.learning.report_budget()
        )  # each client host's report work (controller/serving/report_budget.py)
        self.reports = self._report_process()
        self._serve(ControllerServicer(self.controller, self._tracer(), self.publisher, budget, self.reports))
        self._start_loop("refresh", refresh, self._refresh, first_wait=0.0)
        self._start_loop("decision-tables", refresh, self.publisher.rebuild)
        reports = self.reports
        refit_elsewhere = reports.refit_prior if reports is not None else None
        self._start_loop("prior", self.config.learning.refresh_seconds, lambda: learner.refit_prior(refit_elsewhere))
        self._start_loop("policy-watch", self.config.policy_watch_seconds, self._reload_if_file_changed)
        interval = self.notifier.watchdog_interval()
        if interval:
            self._watchdog = WatchdogPinger(self.notifier, interval, is_healthy=self._healthy)
            self._watchdog.start()
        assert self._redis is not None
        log.info(
            "specd controller listening on %s (%s; policy %s from %s, redis %s%s)%s",
            self.address,
            self._security(),
            policies.current.version,
            policies.current.path,
            redact(self._redis.url),
            ", embedded" if self._redis.embedded else "",
            f"; metrics at http://{self.metrics.address}/metrics" if self.metrics is not None else "",
        )
        self.notifier.ready(f"serving on {self.address}")

    def _load_policy(self) -> PolicyStore:
        try:
            return PolicyStore(load_policy(self.config.policy_path))
        except ConfigError as e:
            raise StartupError(f"the policy is invalid, not starting:\n{e}") from None

    def _open_learning(self) -> Learner:
        cfg = self.config
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self._redis = connect(cfg.redis_url, cfg.state_dir, cfg.redis_timeout_seconds, cfg.redis_tls)
        if self._redis.embedded is not None:
            self._redis.supervise(cfg.redis_restart_backoff_seconds)
        store = TelemetryStore(self._redis.client, cfg.learning.store_config(), self.clock)
        journal = Journal(
            cfg.state_dir / "journal.jsonl", cfg.learning.journal_max_reports, cfg.learning.journal_max_bytes
        )
        learner = Learner(store, journal, self.clock, cfg.learning.prior_retrain_seconds)
        learner.refit_prior()  # importing scikit-learn takes seconds: here, not under the first decisions
        self._redis_reachable = learner.refresh_snapshot()  # the journal waits for the refresh loop
        return learner

    def _report_process(self) -> ReportProcess | None:
        """The child process reports are validated and stored in (it starts in the background), or None: turned off,
        or a clock other than the wall clock's (the child's store keeps the wall clock)."""
        if not self.config.report_process or self.clock is not time.time:
            return None
        assert self._redis is not None
        cfg = self.config
        reports = ReportProcess(
            StoreSpec(self._redis.url, cfg.redis_timeout_seconds, cfg.redis_tls, cfg.learning.store_config())
        )
        reports.start()
        return reports

    def _tracer(self) -> Any:
        exporter = make_exporter(self.config.telemetry.exporter, self.config.telemetry.endpoint)
        if exporter is None:  # nothing would ever read the spans: do not pay for recording them
            return no_tracer()
        self._provider = make_provider(self.config.telemetry.service_name, exporter)
        return self._provider.get_tracer("specd.controller")

    def _serve(self, servicer: ControllerServicer) -> None:
        """The Controller service, health (SERVING) and reflection, on ``listen``."""
        listen, tls = self.config.listen, self.config.tls
        budget = servicer.budget  # a client host over its budget of report work is held before being read
        waited = PrometheusCounter(
            "specd_controller_calls_waited_for_host_turn", "unary calls that waited (holding no thread) because their "
            "client host already had max_calls_per_host calls running", registry=servicer.controller.learner.registry,
        )  # fmt: skip
        self.shares = HostShares(self.config.max_calls_per_host, on_wait=waited.inc)  # each host's share of the pool
        holds = {} if budget is None else {REPORT_ROUNDS: budget.hold_seconds}
        # a stream over the watcher caps is refused on the loop, before its handler takes a pool thread
        gates = {} if servicer.publisher is None else {WATCH_DECISIONS: servicer.publisher.refusal}
        try:
            request_wait = RequestWait(
                WaitLimits.from_environment(), holds=holds, shares=self.shares, gates=gates, on_loop=ON_LOOP
            )
        except ValueError as e:  # a bound in the environment that is not one
            raise StartupError(str(e)) from None
        # a report is read as its bytes and its head; the report process parses the rest (serving/report_head.py)
        decoding = RefuseUndecodable({REPORT_ROUNDS: ReceivedReport.parse})
        server = GrpcServer(
            # threads for handlers only: a call waiting for its request holds none. Every WatchDecisions stream holds
            # one while it waits for the next refresh: max_watchers more, so that they cannot starve Decide
            self.config.max_workers + self.config.max_watchers,
            # refused calls are never counted in flight and never wait for their request; a call's request has a
            # deadline, and the calls waiting for theirs a cap (serving/request_wait.py); bytes that do not parse
            # are INVALID_ARGUMENT, not INTERNAL
            [*self._token_check(), request_wait, self._in_flight, decoding],
            # gRPC binds with SO_REUSEPORT by default: a second daemon on the same port would start silently and
            # the kernel would split the connections between the two. Bind exclusively, so it fails instead.
            [
                ("grpc.so_reuseport", 0),
                # every request is small (a report of 500 aggregates is ~250 KB): a larger one is refused before it
                # is parsed, so no client can hand the controller seconds of parsing under the GIL
                ("grpc.max_receive_message_length", MAX_REPORT_BYTES),
            ],
        )
        request_wait.serve_in(server.pool)  # synchronous handlers run in the server's pool, as grpc.aio runs them
        health_servicer = BoundedHealth()  # a Watch stream waits on the loop, never in a thread; they are bounded

        def register(aio_server: grpc.aio.Server) -> None:
            controller_pb2_grpc.add_ControllerServicer_to_server(servicer, aio_server)
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, aio_server)
            names = (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, aio_server)

        try:
            credentials = None if tls is None else server_credentials(tls)
            port = server.start(listen, credentials, register)
        except (RuntimeError, OSError) as e:  # OSError: a certificate file gone since the config was read
            server.close()
            raise StartupError(f"cannot listen on {listen}: {e}") from None
        if not port:
            server.close()
            raise StartupError(f"cannot listen on {listen} (address in use?)")
        self._server, self._health, self.port = server, health_servicer, port
        for status_name in ("", SERVICE_NAME):
            self._set_health(status_name, health_pb2.HealthCheckResponse.SERVING)
        self._set_health(REDIS_HEALTH, _serving(self._redis_reachable))

    def _set_health(self, service: str, status: Any) -> None:
        if self._server is None or self._health is None:
            return
        with contextlib.suppress(ServerClosed, futures.CancelledError):  # stopped: nobody is left to tell
            self._server.call(self._health.set(service, status))

    def _serve_metrics(self) -> None:
        """GET /metrics on ``metrics.listen`` (controller/serving/metrics_endpoint.py); nothing when it is null."""
        cfg = self.config.metrics
        if cfg.listen is None:
            return
        assert self.controller is not None
        if not is_loopback(cfg.listen):
            log.warning("metrics on %s are served over plain HTTP with no token: whoever reaches the port reads "
                        "every segment's name and figures", cfg.listen)  # fmt: skip
        try:  # at most the store's cap on segments, plus _overflow (every segment past the cap)
            self.metrics = serve_metrics(self.controller, cfg, self.config.learning.max_segments + 1)
        except OSError as e:
            raise StartupError(f"cannot serve metrics on {cfg.listen}: {e.strerror or e}") from None

    def _token_check(self) -> list[grpc.aio.ServerInterceptor]:
        tokens = Tokens.of(self.config.auth)
        return [TokenCheck(tokens)] if tokens is not None else []

    def _security(self) -> str:
        """How the port is guarded, for the start-up line; warns when it is reachable from elsewhere and open."""
        cfg = self.config
        for warning in exposure_warnings(cfg.listen, cfg.tls, cfg.auth):
            log.warning("%s", warning)
        transport = "plaintext" if cfg.tls is None else "mutual TLS" if cfg.tls.mutual else "TLS"
        tokens = "read and write tokens" if cfg.auth.read_token else "a token" if cfg.auth.write_token else "no token"
        return f"{transport}, {tokens}"

    def main_loop(self) -> None:
        while not self.lifecycle.should_exit.wait(0.2):
            if self.lifecycle.take_reload():
                self.reload_policy()

    def shutdown(self) -> Drain:
        """Stop serving (RPCs in flight get the grace period), stop the loops, move what the journal holds into
        Redis, flush spans, close. Copes with a start-up that failed half way."""
        self.lifecycle.request_exit()  # ends the background loops (and main_loop, when called directly)
        self.notifier.stopping("draining")
        if self.publisher is not None:
            self.publisher.close()  # streams end now (workers keep their tables and reconnect elsewhere)
        in_flight, cancelled = self._stop_serving()
        if self.reports is not None:
            self.reports.close()  # after the server: a report in flight is stored first
        if self.metrics is not None:
            self.metrics.close()
        for thread in self._threads:
            thread.join(timeout=5)
        if self._watchdog is not None:
            self._watchdog.stop()
        journaled = 0
        if self.controller is not None:  # a last chance to move journaled reports into Redis, within the grace
            self.controller.learner.refresh(replay_seconds=self.config.shutdown_grace_seconds)
            journaled = len(self.controller.learner.journal)
        if self._provider is not None:
            self._provider.shutdown()
        if self._redis is not None:
            self._redis.close()
        self.notifier.close()
        return Drain(
            finished={"RPCs in flight": in_flight - cancelled},
            cut_short={
                "RPCs cancelled at the end of the grace period": cancelled,
                "reports left in the journal (Redis unreachable; replayed at the next start)": journaled,
            },
            forced=self.lifecycle.force_exit.is_set(),
        )

    def _stop_serving(self) -> tuple[int, int]:
        """Refuse new RPCs and give those in flight the grace period; a second Ctrl-C cancels them at once. Returns
        how many were in flight, and how many of them the end of the grace cancelled."""
        if self._server is None:
            return 0, 0
        log.info("draining (up to %.0fs)", self.config.shutdown_grace_seconds)
        if self._health is not None:
            self._server.call(self._health.enter_graceful_shutdown())  # NOT_SERVING, so balancers move on
        in_flight = self._in_flight.count
        stopped = self._server.stop(self.config.shutdown_grace_seconds)
        while not _done_within(stopped, 0.1):
            if self.lifecycle.force_exit.is_set():
                self._server.stop(0).result()  # a smaller grace than before stops sooner (grpc.aio.Server.stop)
                break
        cancelled = min(self._in_flight.count, in_flight)  # handlers still running once the grace ended
        self._server.close()
        return in_flight, cancelled

    # --- reloads ------------------------------------------------------------------------------------

    def reload_policy(self) -> bool:
        """Reload the policy file; an invalid file is logged and the policy in force stays."""
        assert self.controller is not None
        self.notifier.reloading()
        try:
            policy = self.controller.policies.reload()
            log.info("policy reloaded: version %s", policy.version)
            return True
        except ConfigError as e:
            log.error("policy reload refused, keeping version %s:\n%s", self.controller.policies.current.version, e)
            return False
        finally:
            self.notifier.ready()

    def _reload_if_file_changed(self) -> None:
        if self.controller is not None and self.controller.policies.file_changed():
            self.lifecycle.reload_requested.set()

    # --- plumbing -----------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        host = self.config.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def _healthy(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def _refresh(self) -> float | None:
        """One refresh: the journal replayed for up to a refresh interval, then the snapshot; the Redis health
        follows. Returns 0 (go on at once) while a backlog is being replayed."""
        assert self.controller is not None
        learner = self.controller.learner
        reachable = learner.refresh(replay_seconds=self.config.learning.refresh_seconds)
        if reachable != self._redis_reachable:
            self._redis_reachable = reachable
            self._set_health(REDIS_HEALTH, _serving(reachable))
            if reachable:
                log.info("Redis answers again: health %s SERVING; %d journaled reports left to replay", REDIS_HEALTH,
                         len(learner.journal))  # fmt: skip
            else:
                log.warning("Redis does not answer: health %s NOT_SERVING; deciding from memory (stale), journaling "
                            "reports (%d of %d bytes used)", REDIS_HEALTH, learner.journal.size,
                            learner.journal.max_bytes)  # fmt: skip
        return 0.0 if reachable and len(learner.journal) else None

    def _start_loop(
        self, name: str, every: float, work: Callable[[], float | None], first_wait: float | None = None
    ) -> None:
        """Run ``work`` every ``every`` seconds (the first time after ``first_wait``, default ``every``); a number
        it returns is the wait before its next run instead."""

        def loop() -> None:
            wait = every if first_wait is None else first_wait
            while not self.lifecycle.should_exit.wait(wait):
                wait = every
                try:
                    result = work()
                except Exception:  # a background failure must not kill the loop; it is logged in full
                    log.exception("background task %s failed", name)
                    continue
                if result is not None:
                    wait = result

        thread = threading.Thread(target=loop, name=f"specd-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)


def _serving(yes: bool) -> Any:
    return health_pb2.HealthCheckResponse.SERVING if yes else health_pb2.HealthCheckResponse.NOT_SERVING


def _done_within(future: futures.Future[Any], seconds: float) -> bool:
    return not futures.wait([future], seconds).not_done
