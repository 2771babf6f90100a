"""The controller daemon's lifecycle, in plain sight: run -> startup -> main_loop -> shutdown.

SIGTERM and SIGINT drain gracefully (a second SIGINT forces exit); SIGHUP reloads the policy. systemd is
told READY, RELOADING, STOPPING and pinged for the watchdog through NOTIFY_SOCKET when it is set.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from types import FrameType
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from controller.config import ControllerConfig
from controller.journal import Journal
from controller.learner import Learner
from controller.policy import PolicyStore, load_policy
from controller.redis_conn import RedisHandle, connect, redact
from controller.service import Controller, ControllerServicer
from controller.store import TelemetryStore
from controller.systemd import Notifier, WatchdogPinger
from controller.tracing import make_exporter, make_provider, no_tracer
from controller.yaml_config import ConfigError
from specd_api.errors import SpecdError
from specd_api.v1 import controller_pb2, controller_pb2_grpc

log = logging.getLogger("specd.controller")
SERVICE_NAME = controller_pb2.DESCRIPTOR.services_by_name["Controller"].full_name


class StartupError(SpecdError):
    """The daemon cannot start (bad policy, port in use, Redis unusable)."""


class ControllerDaemon:
    def __init__(self, config: ControllerConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.clock = clock
        self.should_exit = threading.Event()
        self.reload_requested = threading.Event()
        self.notifier = Notifier.from_environment()
        self.port: int | None = None
        self.controller: Controller | None = None
        self._force_exit = False
        self._redis: RedisHandle | None = None
        self._server: grpc.Server | None = None
        self._health: health.HealthServicer | None = None
        self._threads: list[threading.Thread] = []
        self._provider: Any = None
        self._watchdog: WatchdogPinger | None = None

    # --- lifecycle ----------------------------------------------------------------------------------

    def run(self) -> int:
        with self._signals_installed():
            self.startup()
            try:
                self.main_loop()
            finally:
                self.shutdown()
        return 0

    def startup(self) -> None:
        cfg = self.config
        try:
            policies = PolicyStore(load_policy(cfg.policy_path))
        except ConfigError as e:
            raise StartupError(f"the policy is invalid, not starting:\n{e}") from None
        cfg.state_dir.mkdir(parents=True, exist_ok=True)
        self._redis = connect(cfg.redis_url, cfg.state_dir, cfg.redis_timeout_seconds)
        store = TelemetryStore(self._redis.client, cfg.learning.store_config(), self.clock)
        journal = Journal(cfg.state_dir / "journal.jsonl", cfg.learning.journal_max_reports)
        learner = Learner(store, journal, self.clock, cfg.learning.prior_retrain_seconds)
        learner.refresh()
        self.controller = Controller(learner, policies, max_remembered=cfg.learning.max_segments * 2)

        exporter = make_exporter(cfg.telemetry.exporter, cfg.telemetry.endpoint)
        if exporter is None:  # nothing would ever read the spans: do not pay for recording them
            tracer = no_tracer()
        else:
            self._provider = make_provider(cfg.telemetry.service_name, exporter)
            tracer = self._provider.get_tracer("specd.controller")
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=cfg.max_workers))
        controller_pb2_grpc.add_ControllerServicer_to_server(ControllerServicer(self.controller, tracer), self._server)
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        try:
            self.port = self._server.add_insecure_port(cfg.listen)
        except RuntimeError as e:
            raise StartupError(f"cannot listen on {cfg.listen}: {e}") from None
        if not self.port:
            raise StartupError(f"cannot listen on {cfg.listen} (address in use?)")
        self._server.start()
        for status_name in ("", SERVICE_NAME):
            self._health.set(status_name, health_pb2.HealthCheckResponse.SERVING)

        self._start_loop("refresh", cfg.learning.refresh_seconds, learner.refresh)
        self._start_loop("policy-watch", cfg.policy_watch_seconds, self._reload_if_file_changed)
        interval = self.notifier.watchdog_interval()
        if interval:
            self._watchdog = WatchdogPinger(self.notifier, interval, is_healthy=self._healthy)
            self._watchdog.start()
        log.info(
            "specd controller listening on %s (policy %s from %s, redis %s%s)",
            self.address,
            policies.current.version,
            policies.current.path,
            redact(self._redis.url),
            ", embedded" if self._redis.embedded else "",
        )
        self.notifier.ready(f"serving on {self.address}")

    def main_loop(self) -> None:
        while not self.should_exit.wait(0.2):
            if self.reload_requested.is_set():
                self.reload_requested.clear()
                self.reload_policy()

    def shutdown(self) -> None:
        log.info("draining (up to %.0fs)", self.config.shutdown_grace_seconds)
        self.notifier.stopping("draining")
        if self._health is not None:
            self._health.enter_graceful_shutdown()
        if self._server is not None:
            self._server.stop(self.config.shutdown_grace_seconds).wait()
        self.should_exit.set()
        for thread in self._threads:
            thread.join(timeout=5)
        if self._watchdog is not None:
            self._watchdog.stop()
        if self.controller is not None:
            self.controller.learner.refresh()  # a last chance to move journaled reports into Redis
        if self._provider is not None:
            self._provider.shutdown()
        if self._redis is not None:
            self._redis.close()
        self.notifier.close()
        log.info("stopped")

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
            self.reload_requested.set()

    # --- plumbing -----------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        host = self.config.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    def _healthy(self) -> bool:
        return all(t.is_alive() for t in self._threads)

    def _start_loop(self, name: str, every: float, work: Callable[[], object]) -> None:
        def loop() -> None:
            while not self.should_exit.wait(every):
                try:
                    work()
                except Exception:  # a background failure must not kill the loop; it is logged in full
                    log.exception("background task %s failed", name)

        thread = threading.Thread(target=loop, name=f"specd-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    @contextmanager
    def _signals_installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled on the main thread (tests run the daemon on others)
            return
        handlers = {signal.SIGTERM: self._on_exit, signal.SIGINT: self._on_exit, signal.SIGHUP: self._on_hup}
        previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_exit(self, signum: int, frame: FrameType | None) -> None:
        if self.should_exit.is_set() and signum == signal.SIGINT:
            self._force_exit = True
            raise KeyboardInterrupt  # a second Ctrl-C: stop draining
        self.should_exit.set()

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        self.reload_requested.set()
