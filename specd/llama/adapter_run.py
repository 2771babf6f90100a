"""Running the adapter: the llama-servers it owns started (one per endpoint that names no url, each on a free
loopback port, its log beside the others), the controller client started, the HTTP API served until SIGINT or
SIGTERM, then everything stopped."""

from __future__ import annotations

import logging
import socket
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from decoder.worker.config import split_address
from specd.llama.adapter import Adapter, make_app
from specd.llama.adapter_config import AdapterConfig
from specd.llama.endpoints import Setting, offered
from specd.llama.server import running
from specd_client import ClientConfig, ControllerClient

log = logging.getLogger("specd.llama.adapter")


@contextmanager
def endpoints(config: AdapterConfig, log_dir: Path) -> Iterator[dict[Setting, str]]:
    """Every endpoint's base URL, the servers this adapter owns running for as long as the block lasts."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with ExitStack() as stack:
        urls: dict[Setting, str] = {}
        for e in config.endpoints:
            if e.url is not None:
                urls[e.setting] = e.url
                continue
            server = config.server
            assert server is not None  # AdapterConfig requires it for an endpoint without a url
            binary = server.binary or _cached_binary()
            args = (*e.setting.server_args(server.draft_model), *server.args)
            log_file = log_dir / f"llama-server-{e.name.replace(':', '-')}.log"
            urls[e.setting] = stack.enter_context(
                running(binary, server.model, args, log=log_file, threads=server.threads, context=server.context)
            )
            log.info("endpoint %s: %s (log %s)", e.name, urls[e.setting], log_file)
        yield urls


def _cached_binary() -> Path:
    from specd.llama.build import build

    return build()


@contextmanager
def controller_client(config: AdapterConfig, drafters: tuple[str, ...]) -> Iterator[ControllerClient | None]:
    link = config.controller
    if link.address is None:
        yield None
        return
    client = ControllerClient(
        ClientConfig(
            address=link.address, worker_id=f"llama-adapter-{socket.gethostname()}",
            decide_deadline_ms=link.decide_deadline_ms, default_drafter=link.default_drafter,
            default_k=link.default_k, fallback_max_batch_size=config.speculation_max_batch,
            report_interval_s=link.report_interval_seconds, max_buffered_aggregates=link.max_buffered_aggregates,
            credentials=link.credentials(), watch_decisions=drafters if link.watch_decisions else (),
        )
    )  # fmt: skip
    client.start()
    try:
        yield client
    finally:
        client.close()


@contextmanager
def adapter(config: AdapterConfig, log_dir: Path) -> Iterator[Adapter]:
    """The adapter with its endpoints up and its controller client started."""
    with endpoints(config, log_dir) as urls, controller_client(config, offered(tuple(urls))) as client:
        yield Adapter(config, urls, client)


def serve(config: AdapterConfig, log_dir: Path | None = None) -> None:
    import uvicorn

    host, port = split_address(config.listen)
    with tempfile.TemporaryDirectory(prefix="specd-llama-") as scratch, adapter(config, log_dir or Path(scratch)) as a:
        log.info("llama.cpp adapter on http://%s:%d, endpoints %s", host, port, ", ".join(s.name for s in a.settings))
        uvicorn.run(make_app(a), host=host, port=port, log_level="warning")
