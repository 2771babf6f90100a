"""Running the adapter: the llama-servers it owns started (one per endpoint that names no url, each on a free
loopback port, its log beside the others), the controller client started, the HTTP API served until SIGINT or
SIGTERM, then everything stopped."""

from __future__ import annotations

import logging
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI

from decoder.worker.config import split_address
from specd.llama.adapter import Adapter, InFlight, make_app
from specd.llama.adapter_config import AdapterConfig
from specd.llama.endpoints import Setting, offered
from specd.llama.server import ServerFailed, running, tokens
from specd_api.lifecycle import Lifecycle
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
def controller_client(
    config: AdapterConfig, drafters: tuple[str, ...], in_flight: InFlight
) -> Iterator[ControllerClient | None]:
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
        ),
        quiet=in_flight.wait_idle,
    )  # fmt: skip
    client.start()
    try:
        yield client
    finally:
        client.close()


TOKENIZER_PROBE = "def f(x):\n    return {'a': [1, 2.5]}  # Ünïcode, spaces   and\ttabs"


@contextmanager
def adapter(config: AdapterConfig, log_dir: Path) -> Iterator[Adapter]:
    """The adapter with its endpoints up and its controller client started; with ``config.tokenizer``, that
    tokenizer checked against the plain server's on a probe text (ServerFailed when they differ)."""
    in_flight = InFlight()
    with endpoints(config, log_dir) as urls, controller_client(config, offered(tuple(urls)), in_flight) as client:
        tokenizer = local_tokenizer(config.tokenizer) if config.tokenizer is not None else None
        made = Adapter(config, urls, client, tokenizer, in_flight)
        if client is not None and config.calibrate:
            report_calibration(config, urls, client, log_dir)
        if tokenizer is not None:
            ours, served_ids = tokenizer(TOKENIZER_PROBE), tokens(urls[Setting("none", 0)], TOKENIZER_PROBE)
            if ours != served_ids:
                raise ServerFailed(
                    f"tokenizer {config.tokenizer}: it tokenizes a probe text unlike the server "
                    f"({ours[:8]} vs {served_ids[:8]}): not the served model's"
                )
        yield made


def report_calibration(
    config: AdapterConfig, urls: dict[Setting, str], client: ControllerClient, log_dir: Path
) -> None:
    """The engine's costs, timed now (``specd.llama.calibration``), as the controller's first timings: costs only, in
    no segment. A calibration that fails is logged and skipped: the adapter serves without it."""
    from decoder.calibration import CALIBRATION_SEGMENT
    from specd.llama import calibration

    plain = urls[Setting("none", 0)]
    server = config.server
    draft = None
    if server is not None and server.draft_model is not None and any(s.drafter == "draft" for s in urls):
        binary = server.binary or _cached_binary()
        draft = (binary, server.draft_model, (*server.args, "-t", str(server.threads)))
    try:
        prefix = calibration.probe_prefix(plain)
        max_k = max((s.k for s in urls), default=0)
        lookup = any(s.drafter == "prompt_lookup" for s in urls)
        sequences = calibration.measure(plain, prefix, max_k, lookup, draft, log_dir)
    except (OSError, httpx.HTTPError, ServerFailed, ValueError, KeyError) as e:
        log.warning("calibration skipped (%s): the controller prices K with the policy's costs until traffic", e)
        return
    for rounds in sequences:  # each sequence its own report: one observation of the controller's medians
        client.report(segment=CALIBRATION_SEGMENT, rounds=rounds, temperature=0.0, prompt_tokens=len(prefix),
                      self_repetition=0.0, start_up_timings=True)  # fmt: skip


def local_tokenizer(folder: Path) -> Callable[[str], list[int]]:
    """The folder's tokenizer (transformers' fast one) as a function of a text: its ids, special tokens added."""
    from transformers import AutoTokenizer

    try:
        loaded = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ServerFailed(f"tokenizer {folder}: {e}") from None
    return lambda text: [int(t) for t in loaded(text, add_special_tokens=True)["input_ids"]]


def serve(config: AdapterConfig, log_dir: Path | None = None) -> None:
    """Serve until SIGINT or SIGTERM (the lifecycle's handlers, not uvicorn's, which would re-raise the signal and
    leave the servers this adapter owns running); then the servers are stopped and the reports flushed."""
    import uvicorn

    from decoder.worker.process import LifecycleServer

    host, port = split_address(config.listen)
    lifecycle = Lifecycle()
    with (
        lifecycle.signals(),
        tempfile.TemporaryDirectory(prefix="specd-llama-") as scratch,
        adapter(config, log_dir or Path(scratch)) as a,
    ):
        log.info("llama.cpp adapter on http://%s:%d, endpoints %s", host, port, ", ".join(s.name for s in a.settings))
        server_config = uvicorn.Config(make_app(a), host=host, port=port, log_level="warning")
        LifecycleServer(server_config, lifecycle).run()


@contextmanager
def served(app: FastAPI, start_seconds: float = 20.0) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port, in a thread of this process, for as long as the block
    lasts (tests and benchmarks); its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_seconds
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
