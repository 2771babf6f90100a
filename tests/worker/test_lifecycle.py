"""The worker under pressure and at its ends: a full queue (429 + Retry-After), requests past their timeout
(504), SIGTERM while requests are in flight (they finish, the process exits 0), and bad config files (exit 2,
one "file:line: field: reason" line).

The busy workers decode one sequence at a time with tiny-pair's own draft, which a random target almost never
accepts: each round costs three draft steps and a verify for one token, so 480 tokens take about a second."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from decoder.worker.config import load_worker_config
from tests.worker.conftest import TinyPair, Worker, WorkerLauncher

LONG = {"prompt": "The quick brown fox", "max_tokens": 480, "temperature": 0}  # no EOS in 480 greedy tokens


def slow_worker(launcher: WorkerLauncher, name: str, **overrides: Any) -> Worker:
    """Draft K=3 with tiny-pair's own draft (almost never accepted)."""
    drafting = {"default_drafter": "draft", "default_k": 3}
    return launcher.start(name, draft=str(launcher.pair.draft), controller=drafting, **overrides)


class InFlight:
    """A request sent from a thread; ``response`` once it is back."""

    def __init__(self, worker: Worker, body: dict[str, Any], path: str = "/v1/completions") -> None:
        self.response: httpx.Response | None = None
        self.payloads: list[Any] | None = None
        stream = bool(body.get("stream"))
        self.thread = threading.Thread(target=self._stream if stream else self._post, args=(worker, path, body))
        self.thread.start()

    def _post(self, worker: Worker, path: str, body: dict[str, Any]) -> None:
        self.response = worker.post(path, body)

    def _stream(self, worker: Worker, path: str, body: dict[str, Any]) -> None:
        self.payloads = worker.stream(path, body)

    def join(self) -> InFlight:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the request never came back"
        return self


# -- backpressure and graceful drain (one worker: the drain test stops it, so it comes last) -----------------


@pytest.fixture(scope="module")
def busy_worker(launcher: WorkerLauncher) -> Iterator[Worker]:
    """One sequence at a time, one more waiting; the rest are refused."""
    worker = slow_worker(launcher, "busy", max_batch=1, max_queue=1, shutdown_grace_seconds=20)
    yield worker
    launcher.stop(worker)


def test_a_full_queue_answers_429_with_retry_after(busy_worker: Worker):
    before = busy_worker.metrics().total("specd_rejected_requests_total", reason="queue_full")
    running = InFlight(busy_worker, LONG)
    busy_worker.wait_for(lambda: busy_worker.health()["batch_size"] == 1, "the first request decoding")
    waiting = InFlight(busy_worker, LONG)
    busy_worker.wait_for(lambda: busy_worker.health()["queue_depth"] == 1, "the second request queued")

    refused = [
        busy_worker.post("/v1/completions", LONG),
        busy_worker.post("/v1/completions", {**LONG, "stream": True}),  # refused before any event is sent
        busy_worker.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ]
    health = busy_worker.health()
    assert (health["batch_size"], health["queue_depth"]) == (1, 1), "the first requests finished too soon"
    for response in refused:
        assert response.status_code == 429, response.text
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["type"] == "rate_limit_error"
    after = busy_worker.metrics().total("specd_rejected_requests_total", reason="queue_full")
    assert after - before == len(refused)

    for request in (running.join(), waiting.join()):  # the admitted ones are not disturbed
        assert request.response is not None and request.response.status_code == 200
        assert request.response.json()["usage"]["completion_tokens"] == 480
    assert busy_worker.post("/v1/completions", {**LONG, "max_tokens": 4}).status_code == 200


def test_sigterm_drains_requests_in_flight_then_exits_0(busy_worker: Worker, launcher: WorkerLauncher):
    busy_worker.wait_idle()
    decoding = InFlight(busy_worker, {**LONG, "max_tokens": 300})
    busy_worker.wait_for(lambda: busy_worker.health()["batch_size"] == 1, "the first request decoding")
    queued = InFlight(busy_worker, {**LONG, "max_tokens": 100, "stream": True})
    busy_worker.wait_for(lambda: busy_worker.health()["queue_depth"] == 1, "the second request queued")

    started = time.monotonic()
    status = launcher.stop(busy_worker)  # SIGTERM, then wait (SIGKILL only after 20 s)

    assert status == 0, "".join(busy_worker.service.tail)
    assert time.monotonic() - started < 15
    decoding.join()
    assert decoding.response is not None and decoding.response.status_code == 200, decoding.response
    body = decoding.response.json()
    assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (300, "length")
    queued.join()
    assert queued.payloads is not None and queued.payloads[-1] == "[DONE]"
    assert "choices" in queued.payloads[-2], queued.payloads[-3:]
    assert queued.payloads[-2]["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.ConnectError):  # and it is gone
        httpx.get(busy_worker.url + "/health", timeout=2)


# -- timeouts ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def impatient_worker(launcher: WorkerLauncher) -> Iterator[Worker]:
    worker = slow_worker(launcher, "impatient", max_batch=1, request_timeout_seconds=0.3)
    yield worker
    launcher.stop(worker)


def test_a_request_past_its_timeout_is_a_504(impatient_worker: Worker):
    before = impatient_worker.metrics()
    started = time.monotonic()
    decoding = InFlight(impatient_worker, LONG)  # times out decoding
    # decoding, or already timed out: on a loaded machine it can spend its 0.3 s before it is ever in the batch (CI
    # once polled 30 s for a batch that had come and gone); either way it is a 504, which is what this checks
    impatient_worker.wait_for(lambda: impatient_worker.health()["batch_size"] == 1 or not decoding.thread.is_alive(),
                              "the first request decoding")  # fmt: skip
    queued = InFlight(impatient_worker, LONG)  # times out waiting for the slot
    streamed = InFlight(impatient_worker, {**LONG, "stream": True})
    for request in (decoding.join(), queued.join()):
        assert request.response is not None and request.response.status_code == 504, request.response
        error = request.response.json()["error"]
        assert error["type"] == "server_error" and "timed out after 0.3 s" in error["message"]
    assert time.monotonic() - started < 10
    payloads = streamed.join().payloads  # a stream has sent its 200 already: the error comes as an event
    assert payloads is not None and payloads[-1] == "[DONE]" and "timed out" in payloads[-2]["error"]["message"]

    after = impatient_worker.metrics()
    timeouts = after.total("specd_requests_total", status="timeout") - before.total("specd_requests_total",
                                                                                      status="timeout")  # fmt: skip
    assert timeouts == 3
    impatient_worker.wait_idle()
    short = impatient_worker.post("/v1/completions", {**LONG, "max_tokens": 4})
    assert short.status_code == 200 and impatient_worker.health()["status"] == "ok"


# -- bad config files ---------------------------------------------------------------------------------------


def _lines(*lines: str) -> str:
    """A YAML document whose line n is ``lines[n - 1]``."""
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("text", "line", "field", "reason"),
    [
        (_lines("listen: 127.0.0.1:0", "max_batch: 0"), 2, "max_batch", "greater than or equal to 1"),
        (_lines("dtype: float8"), 1, "dtype", "Input should be 'auto'"),
        (_lines("controller:", "  address: null", "  adress: x"), 3, "controller.adress", "Extra inputs"),
        (_lines("controller:", "  default_drafter: draft"), 1, "controller",
         "default_k must be 0 exactly when default_drafter is none"),
        (_lines("prompt_lookup: {min_ngram: 4, max_ngram: 2}"), 1, "prompt_lookup", "must be <= max_ngram"),
        (_lines("request_timeout_seconds: -1"), 1, "request_timeout_seconds", "greater than 0"),
    ],
)  # fmt: skip
def test_a_bad_config_names_file_line_and_field(tmp_path: Path, text: str, line: int, field: str, reason: str):
    path = tmp_path / "worker.yaml"
    path.write_text(text)
    with pytest.raises(Exception) as caught:
        load_worker_config(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:{line}: {field}: "), message
    assert reason in message and "\n" not in message


def test_the_local_plans_k_is_read(tmp_path: Path):
    path = tmp_path / "worker.yaml"
    path.write_text(_lines("controller:", "  default_drafter: draft", "  default_k: 3"))
    assert load_worker_config(path).controller.default_k == 3


def test_specd_worker_exits_2_on_a_bad_config_in_one_line(tmp_path: Path, tiny_pair: TinyPair):
    path = tmp_path / "worker.yaml"
    path.write_text(_lines(f"target: {tiny_pair.target}", "draft: null", "max_queue: lots"))
    done = subprocess.run(
        [sys.executable, "-m", "specd", "worker", "--config", str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"specd worker: error: {path}:3: max_queue: Input should be a valid integer, unable to parse string as an "
        "integer"
    ]
    assert "listening" not in done.stdout
