"""The worker process's lifecycle (decoder/worker/process.py): uvicorn runs under specd_api.lifecycle's signal
handlers and installs none of its own, and the drain is logged, honouring a grace period under a second.

The in-process tests serve a three-line ASGI app; the others run `specd worker` on the tiny pair."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import Any

import httpx
import pytest
import uvicorn

from decoder.worker.process import LifecycleServer, bind
from specd.launch import start
from specd_api.errors import UsageError
from specd_api.lifecycle import Lifecycle
from tests.worker.conftest import WorkerLauncher


async def hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"hello"})


def uvicorn_config() -> uvicorn.Config:
    return uvicorn.Config(hello, lifespan="off", log_level="warning", timeout_graceful_shutdown=1)


def test_uvicorn_serves_under_the_lifecycles_handlers_and_stops_on_its_flag():
    lifecycle = Lifecycle()
    sock = bind("127.0.0.1:0")
    port = sock.getsockname()[1]
    seen: dict[str, Any] = {}
    server = LifecycleServer(uvicorn_config(), lifecycle, drain=lambda: seen.setdefault("drained", True))

    def poke() -> None:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        seen["handler"] = signal.getsignal(signal.SIGTERM)
        seen["body"] = httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text
        os.kill(os.getpid(), signal.SIGTERM)  # handled on the main thread, inside server.run
        deadline = time.monotonic() + 5
        while server.started and "drained" not in seen and time.monotonic() < deadline:
            time.sleep(0.01)
        if "drained" not in seen:  # uvicorn missed the flag: end it, whatever its flags are, and fail below
            seen["still serving"] = True
            uvicorn.Server.__setattr__(server, "should_exit", True)

    with lifecycle.signals():
        thread = threading.Thread(target=poke)
        thread.start()
        server.run(sockets=[sock])
        thread.join()
    assert seen == {"handler": lifecycle.handle, "body": "hello", "drained": True}  # uvicorn installed nothing
    assert lifecycle.exit_signal == signal.SIGTERM


def test_a_signal_before_uvicorn_starts_is_not_lost():
    lifecycle = Lifecycle()
    lifecycle.request_exit()  # e.g. SIGTERM while the models loaded
    server = LifecycleServer(uvicorn_config(), lifecycle)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [bind("127.0.0.1:0")]})
    thread.start()
    thread.join(5)
    served_on = thread.is_alive()
    if served_on:
        uvicorn.Server.__setattr__(server, "should_exit", True)  # end it, whatever its flags are
        thread.join(5)
    assert not served_on, "uvicorn did not see the exit requested before it started"


def test_a_port_in_use_is_one_line():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(UsageError, match=rf"^cannot listen on 127.0.0.1:{port}: Address already in use"):
            bind(f"127.0.0.1:{port}")


# -- the drain, logged (real processes) --------------------------------------------------------------------


def slow_worker_args(launcher: WorkerLauncher, name: str, grace: float) -> list[str]:
    """One sequence at a time, tiny-pair's own draft at K=3 (almost never accepted), through transformers' own
    forward: several ms a token, so a request that fills the tiny pair's 512-token context decodes for seconds (with
    the native pass it took under a second on a quiet machine, and finished inside a 0.5 s grace)."""
    path = launcher.config(
        name, draft=str(launcher.pair.draft), max_batch=1, max_tokens_limit=5000, shutdown_grace_seconds=grace,
        controller={"default_drafter": "draft", "default_k": 3}, runner="transformers",
    )  # fmt: skip
    return ["worker", "--config", str(path), "--log-level", "INFO"]


def sigterm_while_decoding(launcher: WorkerLauncher, name: str, grace: float, max_tokens: int) -> tuple[float, str]:
    """Start a worker, send one long request, SIGTERM it mid-decode; the seconds it took to exit, and its log."""
    log = launcher.folder / f"{name}.log"
    service = start(name, slow_worker_args(launcher, name, grace), log_path=log, timeout_seconds=120)
    try:
        body = {"prompt": "The quick brown fox", "max_tokens": max_tokens, "temperature": 0}
        request = threading.Thread(target=lambda: httpx.post(f"{service.url}/v1/completions", json=body, timeout=60))
        request.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{service.url}/health", timeout=5).json()["batch_size"] != 1:
            assert time.monotonic() < deadline, "the request never started decoding"
            time.sleep(0.02)
        started = time.monotonic()
        assert service.stop(timeout_seconds=30) == 0
        took = time.monotonic() - started
        request.join(30)
    finally:
        service.kill()
    time.sleep(0.1)  # the output pump writes the last lines
    return took, log.read_text()


def test_a_drain_that_finishes_the_request_in_flight_says_so(launcher: WorkerLauncher):
    _, log = sigterm_while_decoding(launcher, "drain-full", grace=20, max_tokens=400)
    assert "stopping: 1 requests in flight get up to 20s" in log
    assert "(1 requests finished); nothing cut short" in log, log
    assert "Traceback" not in log


def test_a_grace_under_a_second_cuts_the_request_short_and_the_log_names_it(launcher: WorkerLauncher):
    # as many tokens as the context holds: seconds of decoding
    took, log = sigterm_while_decoding(launcher, "drain-short", grace=0.5, max_tokens=4800)
    assert took < 5, f"the worker took {took:.1f}s to stop with a 0.5 s grace\n{log}"
    assert "; cut short: 1 requests cancelled" in log and "(nothing in flight)" not in log, log
    assert "Traceback" not in log
