"""What one client's request can do to the others (contract 10), over the real HTTP app in-process (the app over
Starlette's test client, the tiny pair decoding; monkeypatching reaches the engine): values at the limits of the
dtypes they become, a fault in one request's round, the speculation and stop strings a client chooses, and a decode
loop that dies, which must stop the worker process with status 1 (then systemd restarts it)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from decoder.engine import DecodeSession
from decoder.worker.app import build_app
from decoder.worker.config import ClientSpeculation, WorkerConfig, load_worker_config
from decoder.worker.openai_api import MAX_STOP_CHARS
from decoder.worker.process import WorkerProcess
from decoder.worker.service import WorkerService
from specd_api.lifecycle import serve
from tests.waiting import free_port
from tests.worker.conftest import in_process, write_config

MAX_K = 4


@pytest.fixture(scope="module")
def config(tiny_pair, tmp_path_factory) -> WorkerConfig:
    path = write_config(
        tmp_path_factory.mktemp("budgets"), "budgets", tiny_pair, max_batch=4,
        client_speculation={"max_k": MAX_K}, controller={"default_drafter": "draft", "default_k": 3},
    )  # fmt: skip
    return load_worker_config(path)


@pytest.fixture(scope="module")
def service(config) -> Iterator[WorkerService]:
    with in_process(config) as service:
        yield service


@pytest.fixture(scope="module")
def client(service) -> Iterator[TestClient]:
    with TestClient(build_app(service), raise_server_exceptions=False) as client:
        yield client


def complete(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/completions", json={"prompt": "The quick brown fox", "max_tokens": 8, **body})


def assert_serving(client: TestClient) -> None:
    """/health is 200 and a sampled request is answered: the decode loop is alive."""
    assert client.get("/health").status_code == 200, client.get("/health").text
    response = complete(client, temperature=1.0, seed=1)
    assert response.status_code == 200, response.text


# -- values at the limits of their dtypes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "status", "why"),
    [
        ("top_p", 1e-46, 200, "positive as a double, 0 in float32: the nucleus is the top token, never an empty "
                              "one (which kills the decode thread: every later request 503)"),
        ("top_p", 5e-324, 200, "the smallest positive double"),
        ("top_p", 1 - 1e-12, 200, "below 1 as a double, 1.0 in float32"),
        ("temperature", 1e-45, 200, "float32's smallest subnormal: greedy"),
        ("temperature", 1e-5, 200, "the smallest temperature that samples: logits scaled 100,000x stay finite"),
        ("temperature", 1e38, 400, "above OpenAI's bound of 2 (and near float32's largest)"),
        ("top_k", (1 << 31) - 1, 200, "the largest int32: larger than the vocabulary is no filter"),
        ("top_k", 1 << 31, 400, "past int32, the controller's wire type: it would have been a silent fallback"),
        ("top_k", 10**30, 400, "past any integer type"),
        ("seed", (1 << 64) - 1, 200, "the largest seed a torch generator takes"),
        ("seed", 1 << 64, 400, "past it"),
        ("seed", -(1 << 63), 200, "the smallest"),
    ],
)  # fmt: skip
def test_a_value_at_a_dtype_limit_is_served_or_refused_naming_it_and_the_worker_serves_on(
    client: TestClient, field: str, value: float, status: int, why: str
):
    for stream in (False, True):
        response = complete(client, **{"temperature": 1.0, field: value, "stream": stream})
        assert response.status_code == status, (why, response.text)
        if status == 200 and stream:
            assert response.text.endswith("data: [DONE]\n\n") and "server_error" not in response.text, response.text
        if status == 400:
            assert response.json()["error"]["param"] == field, why
        assert_serving(client)


def test_a_vanishing_top_p_samples_the_greedy_text(client: TestClient):
    """top_p 1e-46 keeps the most likely token only: sampling then writes the greedy text, whatever the seed."""
    greedy = complete(client, temperature=0, max_tokens=12).json()["choices"][0]["text"]
    for seed in (1, 2):
        sampled = complete(client, temperature=1.0, top_p=1e-46, seed=seed, max_tokens=12)
        assert sampled.status_code == 200, sampled.text
        assert sampled.json()["choices"][0]["text"] == greedy


# -- a fault in one request's round ---------------------------------------------------------------------------

POISON = [9, 9, 9, 9, 9, 9]  # a prompt given as token ids; its rounds raise once it has a few tokens


def test_a_fault_in_one_requests_round_fails_that_request_only(client: TestClient, monkeypatch):
    """Three requests decode together; one's round raises. It gets a 500 naming the error; the two others finish
    with their own text, /health stays 200 and the next request is served: the exception must not end the decode
    thread, failing all three and every later request with a 503 from a process that stays up."""
    innocent = {"prompt": "The quick brown fox", "max_tokens": 40, "temperature": 0}
    alone = client.post("/v1/completions", json=innocent).json()["choices"][0]["text"]
    finish_round = DecodeSession.finish_round

    def faulty(self: DecodeSession, *args: Any, **kwargs: Any) -> list[int]:
        if self.context[:6].tolist() == POISON and len(self.generated) >= 3:
            raise RuntimeError("a fault in one sequence's round")
        return finish_round(self, *args, **kwargs)

    monkeypatch.setattr(DecodeSession, "finish_round", faulty)
    bodies = [innocent, {"prompt": POISON, "max_tokens": 40, "temperature": 0}, innocent]
    answers: list[Any] = [None] * len(bodies)

    def send(i: int) -> None:
        answers[i] = client.post("/v1/completions", json=bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    first, poisoned, second = answers
    assert poisoned.status_code == 500, poisoned.text
    assert "a fault in one sequence's round" in poisoned.json()["error"]["message"]
    for answer in (first, second):
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == alone
    assert_serving(client)


# -- what a client may choose ---------------------------------------------------------------------------------


def test_a_clients_k_is_bounded_by_the_workers_setting(client: TestClient):
    """Four clients asking for the draft model at K=64 make every other request ~10x slower (docs/RELIABILITY.md),
    so K is bounded by client_speculation.max_k."""
    at = complete(client, temperature=0, speculation={"drafter": "draft", "k": MAX_K})
    assert at.status_code == 200 and at.json()["specd"]["k"] == MAX_K, at.text
    over = complete(client, temperature=0, speculation={"drafter": "draft", "k": MAX_K + 1})
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert error["param"] == "speculation.k"
    assert error["message"] == (
        f"speculation.k: {MAX_K + 1} is above this worker's limit of {MAX_K} (client_speculation.max_k)"
    )


def test_a_worker_may_refuse_client_speculation(client: TestClient, service: WorkerService):
    before = service.cfg
    service.cfg = before.model_copy(update={"client_speculation": ClientSpeculation(allowed=False)})
    try:
        refused = complete(client, speculation={"drafter": "none", "k": 0})
        served = complete(client)
    finally:
        service.cfg = before
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "speculation", refused.text
    assert "client_speculation.allowed" in refused.json()["error"]["message"]
    assert served.status_code == 200, served.text


@pytest.mark.parametrize("stop", ["x" * (MAX_STOP_CHARS + 1), ["a", "x" * 200_000]], ids=["one", "in-a-list"])
def test_a_stop_string_is_bounded_in_length(client: TestClient, stop: str | list[str]):
    """200,000-character stop strings slowed an innocent stream 3.3x (each is matched every round)."""
    response = complete(client, stop=stop)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "stop"
    assert f"at most {MAX_STOP_CHARS} each" in error["message"] and "characters" in error["message"]
    at_limit = complete(client, stop=["x" * MAX_STOP_CHARS, "y"])
    assert at_limit.status_code == 200, at_limit.text


# -- a decode loop that dies -----------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_decode_loop_stops_the_worker_with_status_1(config: WorkerConfig):
    """A fault outside every request (here: admitting) ends the decode loop. The worker then answers 503 and stops
    as on SIGTERM, exiting 1: systemd's Restart=on-failure brings it back. It never stays up with a dead loop,
    answering 503 for good."""
    port = free_port()
    worker = WorkerProcess(config.model_copy(update={"listen": f"127.0.0.1:{port}", "warm_up": False}), "WARNING")
    url = f"http://127.0.0.1:{port}"
    seen: dict[str, Any] = {}

    def break_the_loop() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.05)
        scheduler = worker.service.scheduler
        assert scheduler is not None

        def broken_admit() -> None:
            raise RuntimeError("a bug outside every request")

        scheduler._admit = broken_admit  # type: ignore[method-assign]
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
        seen["status"], seen["error"] = answer.status_code, answer.json()["error"]["message"]
        deadline = time.monotonic() + 30
        while not worker.lifecycle.should_exit.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        if not worker.lifecycle.should_exit.is_set():  # the worker served on: end it, and fail below
            seen["served on"] = True
            worker.lifecycle.request_exit()

    thread = threading.Thread(target=break_the_loop)
    thread.start()
    try:
        serve(worker, logging.getLogger("specd.worker"))
    finally:
        thread.join(60)
    assert seen["status"] == 500 and "a bug outside every request" in seen["error"], seen
    assert "served on" not in seen, "the worker kept serving with a dead decode loop"
    assert worker.exit_status == 1
    assert isinstance(worker.service.scheduler.failure, RuntimeError)  # type: ignore[union-attr]


# -- the collector --------------------------------------------------------------------------------------------


def test_the_worker_puts_what_start_up_made_out_of_the_collectors_reach(config: WorkerConfig):
    """A full collection walked the models, the tokenizer and every module: 0.2 s holding the interpreter, set off
    by a large prompt's tokens, and /health (every request on the event loop) waited as long. Start-up's objects
    are frozen, so a full collection walks only what came since."""
    import gc

    gc.unfreeze()
    worker = WorkerProcess(config.model_copy(update={"listen": "127.0.0.1:0", "warm_up": False}), "WARNING")
    try:
        worker.startup()
        frozen = gc.get_freeze_count()
        engine = worker.service.engine
        assert engine is not None
        assert frozen > 10_000, frozen  # the modules, the models and the tokenizer
        assert all(tracked is not engine for tracked in gc.get_objects())  # the engine is out of the collector's reach
    finally:
        gc.unfreeze()
        worker.shutdown()
