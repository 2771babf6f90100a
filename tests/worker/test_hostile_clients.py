"""Hostile clients against a real `specd worker` process, over raw sockets where a client library would not misbehave
enough: requests that never arrive whole, connections that send nothing, half-sent requests at a stop, and a prompt
built to be slow to classify. Unbounded, each would hold a connection, the event loop or the stop for as long as the
client liked, or log a traceback per request."""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from specd.launch import start
from tests.daemons import ipv6_loopback
from tests.worker.conftest import Worker, WorkerLauncher, assert_clean_log
from tests.worker.test_segments import blank_lines_then_an_if

READ_SECONDS = 1.0


def start_worker(launcher: WorkerLauncher, name: str, **overrides: object) -> Worker:
    """A worker logging at INFO (the lines these tests look for), stopped by the test or its fixture."""
    path = launcher.config(name, **overrides)
    log = launcher.folder / f"{name}.log"
    service = start(name, ["worker", "--config", str(path), "--log-level", "INFO"], log_path=log, timeout_seconds=120)
    return Worker(service, log)


@pytest.fixture(scope="module")
def worker(launcher: WorkerLauncher) -> Iterator[Worker]:
    """Requests must arrive within READ_SECONDS; heuristic segments; prompts of up to 200,000 characters (the
    default) and as many tokens as they make (so that the slowest prompt to classify gets that far)."""
    worker = start_worker(
        launcher, "hostile", draft=None, segment_classifier="heuristic",
        limits={"request_read_seconds": READ_SECONDS, "max_prompt_tokens": 1_000_000},
    )  # fmt: skip
    try:
        yield worker
    finally:
        worker.service.stop(timeout_seconds=20)
        worker.service.kill()
    assert_clean_log(worker)


def seconds_until_closed(sock: socket.socket, limit: float = 10.0) -> float:
    """How long until the worker closes ``sock`` (reading and dropping whatever it sends first)."""
    started = time.monotonic()
    sock.settimeout(limit)
    while sock.recv(65536):
        pass
    return time.monotonic() - started


BODY = json.dumps({"prompt": "hello", "max_tokens": 2}).encode()
HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
HALF_SENT = {
    "nothing": b"",
    "half the headers": HEAD[:40],
    "the headers, half the body": HEAD % len(BODY) + BODY[: len(BODY) // 2],
    "a second request, half of it": HEAD % len(BODY) + BODY + HEAD[:40],
}


@pytest.mark.parametrize("sent", sorted(HALF_SENT))
def test_a_request_that_never_arrives_whole_is_dropped_at_the_deadline(worker: Worker, sent: str):
    """uvicorn cancels its keep-alive timer on every byte and has no deadline for a request, so each of these held a
    connection (a file descriptor) until the worker stopped."""
    with worker.connect() as sock:
        sock.sendall(HALF_SENT[sent])
        took = seconds_until_closed(sock)
    assert READ_SECONDS * 0.9 <= took < READ_SECONDS + 3, f"closed after {took:.2f} s"
    assert worker.health()["status"] == "ok"
    time.sleep(0.1)  # the output pump writes the line
    assert f"no whole request within {READ_SECONDS:g}s (limits.request_read_seconds)" in worker.log.read_text()


@pytest.mark.parametrize("sent", sorted(set(HALF_SENT) - {"nothing"}))
def test_a_client_that_goes_away_half_way_costs_no_traceback(worker: Worker, sent: str):
    """Half a request, then the client closes (or resets) its end: nothing to answer, nothing logged as an error."""
    for reset in (False, True):
        with worker.connect() as sock:
            sock.sendall(HALF_SENT[sent])
            time.sleep(0.05)
            if reset:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    assert worker.health()["status"] == "ok"
    time.sleep(0.1)
    assert "Traceback" not in worker.log.read_text()


def test_a_slow_request_within_the_deadline_and_kept_alive_connections_are_served(worker: Worker):
    """The deadline is for a request to arrive: one that trickles in within it is served, and a connection kept
    alive serves its next request after an idle spell (the deadline counts from the previous response, so the idle
    time and the next request's arrival share it)."""
    with worker.connect() as sock:
        for _ in range(2):
            request = HEAD % len(BODY) + BODY
            time.sleep(READ_SECONDS / 4)  # idle
            for i in range(0, len(request), 20):  # then half the deadline to send it
                sock.sendall(request[i : i + 20])
                time.sleep(READ_SECONDS / 2 / (len(request) / 20))
            reply = sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]


def test_each_response_leaves_at_once_on_a_kept_alive_connection(worker: Worker):
    """h11 sends a response's head and its body apart. Accepted sockets have Nagle's algorithm on unless turned off
    (asyncio turns it off only for a socket whose protocol number says TCP, and ``socket.create_server`` leaves 0),
    and then the body waits for the client's delayed ACK: at least 40 ms on Linux, on every response of a kept-alive
    connection (/health 44 ms, a completion of 8 tokens 48 ms against 5). The median over one connection tells the two
    apart whatever the machine's noise."""
    with worker.connect() as sock:
        latencies = []
        for _ in range(21):
            started = time.perf_counter()
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: specd\r\n\r\n")
            reply = b""
            while not reply.endswith(b"}"):
                chunk = sock.recv(65536)
                assert chunk, reply
                reply += chunk
            latencies.append(time.perf_counter() - started)
            assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
    assert sorted(latencies)[10] < 0.02, latencies


def test_health_answers_while_the_slowest_prompt_to_classify_is_in_flight(worker: Worker):
    """The slowest prompt to classify found (tests/worker/test_segments.py), as large as the limits allow: 40,000 blank
    lines, then an ``if`` line with no colon. Patterns that rescan the rest from every line start take minutes of
    event loop, /health frozen; the classifier reads a bounded window with linear patterns, off the loop.

    The bound is 2 s, not a latency target: rescanning patterns freeze /health for 16-40 s, and this machine's own
    stalls (a second happens on a shared CI host, so a 0.5 s bound is too tight) must not fail the test."""
    prompt = blank_lines_then_an_if()
    result: dict[str, object] = {}

    def send() -> None:
        started = time.perf_counter()
        response = httpx.post(f"{worker.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=120)
        result.update(status=response.status_code, text=response.text, seconds=time.perf_counter() - started)

    latencies: list[float] = []
    sender = threading.Thread(target=send)
    with worker.client(timeout=3.0) as client:  # a /health slower than this fails the test
        sender.start()
        while sender.is_alive():
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    sender.join()
    # The prompt is classified, then refused by the engine: it is longer than the tiny target's context.
    assert result["status"] == 400 and "context" in str(result["text"]), result
    assert max(latencies, default=0.0) < 2.0, latencies


def test_half_sent_requests_do_not_hold_the_stop_nor_log_tracebacks(launcher: WorkerLauncher):
    """At SIGTERM, uvicorn waited for each half-sent request's task through the whole grace period (grace + 1 s),
    then cancelled it with a traceback each (thousands of them: 52 MB of log in 12 s). A request still arriving at a
    stop has nothing admitted to drain: it is closed at once, in one line for all of them."""
    worker = start_worker(
        launcher, "half-sent", draft=None, shutdown_grace_seconds=5, limits={"request_read_seconds": 60}
    )
    socks = []
    try:
        for sent in ("the headers, half the body", "half the headers"):
            for _ in range(3):
                sock = worker.connect()
                sock.sendall(HALF_SENT[sent])
                socks.append(sock)
        time.sleep(0.3)
        started = time.monotonic()
        os.kill(worker.service.process.pid, signal.SIGTERM)
        status = worker.service.process.wait(timeout=30)
        took = time.monotonic() - started
    finally:
        for sock in socks:
            sock.close()
        worker.service.kill()
    assert status == 0
    assert took < 3, f"the stop took {took:.1f} s with a grace of 5 s"
    time.sleep(0.1)
    log = worker.log.read_text()
    # one line, then the others counted (a client's thousands of connections must not write thousands of lines)
    assert log.count("stopping: closed a connection from 127.0.0.1:") == 1, log
    assert "and 2 more like the last line" in log, log
    assert_clean_log(worker)


def test_one_hosts_connections_leave_other_hosts_served(launcher: WorkerLauncher):
    """uvicorn's limit_concurrency counts every client's connections together: one host's 4,200 idle connections
    (past max_connections, 4,096) would make every other client's request a 503. Each client address holds at most
    limits.max_connections_per_host: a connection past it is answered 503 at once and closed, and another
    address is served. A worker listening on [::] takes calls from ::1 and from 127.0.0.1 (as ::ffff:127.0.0.1)."""
    if not ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine: the test needs connections from two addresses")
    worker = start_worker(launcher, "per-host", draft=None, listen="[::]:0",
                          limits={"max_connections": 60, "max_connections_per_host": 20})  # fmt: skip
    port = int(worker.service.address.rsplit(":", 1)[1])
    held: list[socket.socket] = []
    try:
        for _ in range(20):  # the host's share, idle
            held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        time.sleep(0.3)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as over:
            reply = _read_all(over)
        assert reply.startswith(b"HTTP/1.1 503 "), reply[:200]
        assert b"max_connections_per_host" in reply and b"retry-after: 1" in reply.lower()
        with httpx.Client(base_url=f"http://[::1]:{port}", timeout=10) as other:
            assert other.get("/health").status_code == 200
        for sock in held[:5]:  # the host gives some back: it is served again (once the worker has seen them go)
            sock.close()
        deadline = time.monotonic() + 10
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as again:
            while (status := again.get("/health").status_code) != 200 and time.monotonic() < deadline:
                time.sleep(0.1)
        assert status == 200
    finally:
        for sock in held:
            sock.close()
        worker.service.stop(timeout_seconds=20)
    log = worker.log.read_text()
    assert log.count("limits.max_connections_per_host") == 1, log[-2000:]  # logged once a minute at most


def _read_all(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data
