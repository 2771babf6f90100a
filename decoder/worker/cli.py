"""`specd worker`: load the models once and serve the OpenAI-compatible API until SIGTERM/SIGINT.

Lifecycle (uvicorn's, around ours): startup (models, decode thread, controller client, tracing) -> serve ->
on SIGTERM uvicorn stops accepting and waits for open requests (``shutdown_grace_seconds``) -> drain the
decode loop, flush telemetry to the controller and spans to the exporter -> exit 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

from specd_api.errors import UsageError


def add_parser(commands: Any) -> None:
    p = commands.add_parser("worker", help="serve the OpenAI-compatible decode worker")
    p.add_argument("--config", default="configs/worker.yaml", help="worker configuration (YAML)")
    p.add_argument("--listen", help="host:port, overriding the config's listen (port 0 picks a free one)")
    p.add_argument("--controller", help="controller host:port, overriding the config ('none': no controller)")
    p.add_argument("--log-level", default="WARNING", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    p.set_defaults(handler=run)


def split_address(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"listen address must be host:port, got {listen!r}")
    return host, int(port)


def run(args: argparse.Namespace) -> int:
    from decoder.worker.config import load_worker_config

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cfg = load_worker_config(args.config)  # before the heavy imports (torch, uvicorn): a bad file fails at once
    overrides: dict[str, Any] = {}
    if args.listen:
        overrides["listen"] = args.listen
    if args.controller:
        address = None if args.controller == "none" else args.controller
        overrides["controller"] = cfg.controller.model_copy(update={"address": address})
    cfg = cfg.model_copy(update=overrides)
    host, port = split_address(cfg.listen)

    import uvicorn

    from decoder.worker.app import build_app
    from decoder.worker.service import WorkerService

    service = WorkerService(cfg)
    try:
        with _sigterm_raises():
            service.startup(worker_id=cfg.listen)
            server = uvicorn.Server(
                uvicorn.Config(
                    build_app(service),
                    host=host,
                    port=port,
                    log_level=args.log_level.lower(),
                    access_log=False,
                    timeout_graceful_shutdown=int(cfg.shutdown_grace_seconds) or None,
                    lifespan="off",
                )
            )
            _Announcer(server, service).install()
            server.run()
    except _Terminated:
        pass  # uvicorn has already stopped accepting and waited for open requests
    finally:
        service.shutdown()
    return 0 if service.scheduler is None or service.scheduler.failure is None else 1


class _Terminated(Exception):
    """SIGTERM arrived (during start-up, or re-raised by uvicorn after its graceful shutdown)."""


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """uvicorn handles SIGTERM while it serves, then re-raises it once it has stopped; with the default
    handler that kills the process before ``service.shutdown()`` (drain, telemetry and span flush) runs. Here
    it becomes an exception, so the ``finally`` does run."""

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise _Terminated

    if threading.current_thread() is not threading.main_thread():
        yield  # signals can only be handled on the main thread
        return
    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Announcer:
    """Prints the bound address once uvicorn has started (port 0 picks a free one): tests and the demo
    read this line."""

    def __init__(self, server: Any, service: Any) -> None:
        self.server, self.service = server, service

    def install(self) -> None:
        original = self.server.startup

        async def startup(sockets: Any = None) -> None:
            await original(sockets=sockets)
            for srv in getattr(self.server, "servers", []):
                for sock in srv.sockets:
                    host, port = sock.getsockname()[:2]
                    cfg, drafters = self.service.cfg, ", ".join(self.service.engine.drafters)
                    print(
                        f"specd worker listening on http://{host}:{port} (model {cfg.model_name}, drafters "
                        f"{drafters}, controller {cfg.controller.address or 'none'})",
                        flush=True,
                    )
                    return

        self.server.startup = startup
