"""The worker's input limits over its real path (a `specd worker` process, raw HTTP as a hostile client writes it):
the body bound on its raw bytes (declared or chunked), prompts bounded before tokenizing, tokenizing off the event
loop, and the segment label set of /metrics bounded however many segments clients invent."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.worker.conftest import Worker

MAX_BODY = 4 << 20
MAX_CHARS = 2_500_000
MAX_TOKENS = 300
MAX_SEGMENTS = 5
WIDE_TOKENS = 10_000_000  # past any prompt of MAX_CHARS: tokenized whole (seconds), refused for the model's context


@pytest.fixture(scope="module")
def worker(launcher) -> Worker:
    return launcher.start(
        "limits", draft=None, segment_classifier="none", default_segment="tenant-a",
        limits={"max_request_bytes": MAX_BODY, "max_prompt_chars": MAX_CHARS, "max_prompt_tokens": MAX_TOKENS},
        metrics={"max_segments": MAX_SEGMENTS},
        client_segments={"max_names": 0},  # the metrics' own bound is tested here: every name a client sends
    )  # fmt: skip


@pytest.fixture(scope="module")
def wide(launcher) -> Worker:
    """A worker whose token limit no prompt reaches: a large prompt is tokenized whole (seconds), then refused."""
    return launcher.start(
        "limits-wide", draft=None, segment_classifier="none",
        limits={"max_request_bytes": MAX_BODY, "max_prompt_chars": MAX_CHARS, "max_prompt_tokens": WIDE_TOKENS},
    )  # fmt: skip


def padded(size: int) -> bytes:
    """A valid completion request of exactly ``size`` bytes (an ignored field carries the padding)."""
    head, tail = b'{"prompt": "hi", "max_tokens": 1, "pad": "', b'"}'
    return head + b"z" * (size - len(head) - len(tail)) + tail


def post_raw(worker: Worker, content: bytes | Iterator[bytes], path: str = "/v1/completions") -> httpx.Response:
    with worker.client() as client:
        return client.post(path, content=content, headers={"content-type": "application/json"})


# -- the request body -------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_the_body_limit_is_exact(worker: Worker, chunked: bool):
    """At the limit the request is served; one byte past it, 413. A chunked body (no Content-Length, as a client
    streaming its upload sends) is counted as it arrives."""

    def send(body: bytes) -> httpx.Response:
        return post_raw(worker, iter([body[:1000], body[1000:]]) if chunked else body)

    at_limit = send(padded(MAX_BODY))
    assert at_limit.status_code == 200, at_limit.text
    over = send(padded(MAX_BODY + 1))
    assert over.status_code == 413, over.text
    error = over.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith("the request body is too large") and f"{MAX_BODY} bytes" in error["message"]
    assert "limits.max_request_bytes" in error["message"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_50_mb_body_is_refused_before_it_is_parsed(worker: Worker, chunked: bool):
    """A 50 MB body is never parsed nor answered. With a Content-Length it is refused before a byte is read;
    chunked, once the limit is passed (the rest is never parsed)."""
    body = padded(50_000_000)
    started = time.perf_counter()
    response = post_raw(worker, (body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)) if chunked else body)
    assert response.status_code == 413, response.text
    assert time.perf_counter() - started < 5.0
    assert worker.health()["status"] == "ok"


def test_a_declared_length_past_the_limit_is_refused_before_the_body_is_sent(worker: Worker):
    """The headers alone (Content-Length: 50,000,000) get the 413: the worker does not wait for the body."""
    with worker.connect(timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 50000000\r\n\r\n")  # fmt: skip
        reply = b""
        while b"limits.max_request_bytes" not in reply:  # a timeout (5 s) here means the worker waited for the body
            chunk = sock.recv(4096)
            assert chunk, f"the connection closed after {reply!r}"
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b"Content-Length is 50000000 bytes" in reply


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_past_the_limit_gets_its_413_whole_not_a_reset(worker: Worker, chunked: bool):
    """16 MB (four times the limit, more than the socket buffers hold) from a client that sends its whole body before
    reading, with ``Connection: close``. Closed with the body unread, the kernel resets the connection, and the
    client's send fails (EPIPE, ECONNRESET) before it can read its 413; so the rest of the body is read and dropped
    (bounded) before the 413 ends and the connection closes in order."""
    body = padded(MAX_BODY * 4)
    framing = b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % len(body)
    if chunked:
        pieces = [body[i : i + 65536] for i in range(0, len(body), 65536)]
        body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces) + b"0\r\n\r\n"
    with worker.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                     b"Content-Type: application/json\r\n" + framing + b"\r\n\r\n" + body)  # fmt: skip
        reply = b""
        while chunk := sock.recv(65536):  # to the worker's orderly close (a reset raises here)
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b"connection: close" in reply.lower() and reply.endswith(b"}}"), reply[-200:]
    assert worker.health()["status"] == "ok"


# -- prompts ----------------------------------------------------------------------------------------------


def test_a_text_prompt_past_the_character_limit_is_refused_before_tokenizing(worker: Worker):
    """2.5 M characters take the tiny tokenizer seconds; one more is refused at once, naming the field."""
    started = time.perf_counter()
    response = post_raw(worker, json.dumps({"prompt": "a " * (MAX_CHARS // 2) + "b"}).encode())
    seconds = time.perf_counter() - started
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert error["message"] == (
        f"prompt: {MAX_CHARS + 1} characters is above this worker's limit of {MAX_CHARS} (limits.max_prompt_chars)"
    )
    assert seconds < 1.0, f"{seconds:.2f} s: was it tokenized first?"


def test_a_chat_is_bounded_by_its_message_texts_together(worker: Worker):
    half = "a" * (MAX_CHARS // 2)
    messages = [{"role": "system", "content": half}, {"role": "user", "content": [{"type": "text", "text": half}]},
                {"role": "user", "content": "b"}]  # fmt: skip
    response = post_raw(worker, json.dumps({"messages": messages}).encode(), "/v1/chat/completions")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and error["message"].startswith(f"messages: {MAX_CHARS + 1} characters")


@pytest.mark.parametrize(
    ("prompt", "status", "why"),
    [
        (list(range(1, MAX_TOKENS + 1)), 200, "token ids at the limit"),
        (list(range(1, MAX_TOKENS + 2)), 400, "one id past it"),
        ("hello " * MAX_TOKENS, 400, "a text prompt counts once tokenized (a word and a space are two tokens or more)"),
    ],
)
def test_the_token_limit(worker: Worker, prompt: list[int] | str, status: int, why: str):
    response = worker.post("/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert response.status_code == status, (why, response.text)
    if status == 400:
        error = response.json()["error"]
        assert error["param"] == "prompt", why
        assert error["message"].endswith(f"tokens is above this worker's limit of {MAX_TOKENS} "
                                         "(limits.max_prompt_tokens)"), why  # fmt: skip


def test_a_long_prompt_is_refused_where_tokenizing_passes_the_limit(worker: Worker):
    """240,000 characters are 80,000 tokens; the worker stops tokenizing one batch of text (16,384 characters) past
    the limit, and the count it names is where it stopped."""
    response = worker.post("/v1/completions", {"prompt": "hello " * 40_000, "max_tokens": 1})
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("prompt: at least ") and message.endswith(
        f"tokens is above this worker's limit of {MAX_TOKENS} (limits.max_prompt_tokens)"
    ), message
    counted = int(message.removeprefix("prompt: at least ").split(" ", 1)[0])
    assert MAX_TOKENS < counted <= 8_000, message


def test_health_answers_while_a_large_prompt_is_tokenized(wide: Worker):
    """A 2.4 MB prompt (within the character limit) keeps the tokenizer busy for seconds before the token limit
    refuses it. Tokenized on the event loop, /health stalled for all of that (5 MB: 9.3 s); off it, /health
    answers throughout (the GIL is held only while transformers turns the ids into Python lists)."""
    prompt = ("The quick brown fox jumps over the lazy dog. " * 60_000)[: MAX_CHARS - 100_000]
    latencies: list[float] = []
    result: dict[str, float | int] = {}

    def send() -> None:
        started = time.perf_counter()
        response = httpx.post(wide.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=120)
        result.update(status=response.status_code, seconds=time.perf_counter() - started)

    sender = threading.Thread(target=send)
    with wide.client(timeout=60) as client:
        sender.start()
        while sender.is_alive():
            started = time.perf_counter()
            assert client.get("/health").status_code == 200
            latencies.append(time.perf_counter() - started)
            time.sleep(0.02)
    sender.join()
    assert result["status"] == 400, "the prompt should have been tokenized, then refused for the model's context"
    assert result["seconds"] > 1.0, f"tokenizing took {result['seconds']:.2f} s: too little to tell anything"
    assert len(latencies) >= 5, latencies
    assert max(latencies) < result["seconds"] / 3, (
        f"/health took up to {max(latencies):.2f} s during a {result['seconds']:.2f} s tokenization"
    )


def _timed_posts(worker: Worker, sends: list[tuple[float, str, str]]) -> dict[str, tuple[int, float]]:
    """Each (delay, source address, prompt) sent after its delay from its own loopback address, concurrently: the
    status and seconds of each, by its index."""
    results: dict[str, tuple[int, float]] = {}

    def send(index: int, delay: float, source: str, prompt: str) -> None:
        time.sleep(delay)
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(base_url=worker.url, timeout=120, transport=transport) as client:
            started = time.perf_counter()
            response = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            results[str(index)] = (response.status_code, time.perf_counter() - started)

    threads = [threading.Thread(target=send, args=(i, *s)) for i, s in enumerate(sends)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


FLOOD = ("The quick brown fox jumps over the lazy dog. " * 60_000)[: MAX_CHARS - 100_000]


def test_one_hosts_large_prompts_hold_up_neither_small_prompts_nor_other_hosts(wide: Worker):
    """Three 2.4 MB prompts from one host (each tokenized for a second or more, refused for the model's context)
    are in the tokenizer when a small prompt from the same host and a 20,000-character one from another host
    arrive. The small one waits for no large one; the other host's waits for at most the one running, not the
    flood's queue (one tokenizing thread in arrival order would serve both after all three)."""
    other = "Pack my box with five dozen liquor jugs. " * 500  # 20,500 characters: the large lane, but quick
    sends = [(0.0, "127.0.0.1", FLOOD), (0.05, "127.0.0.1", FLOOD), (0.1, "127.0.0.1", FLOOD),
             (0.6, "127.0.0.1", "hello"), (0.6, "127.0.0.2", other)]  # fmt: skip
    results = _timed_posts(wide, sends)
    flood = [results[str(i)][1] for i in range(3)]
    assert [results[str(i)][0] for i in range(3)] == [400, 400, 400]
    one = min(flood) - 0.1  # at least one tokenization: the first's own time, less its delay
    assert one > 1.0, f"the flood's prompts took {flood}: too little to tell anything"
    small_status, small = results["3"]
    assert small_status == 200 and small < one / 2, f"the small prompt took {small:.2f} s beside {flood}"
    other_status, other_seconds = results["4"]
    assert other_status == 400  # 20,500 characters: more tokens than the model's context
    assert other_seconds < 1.7 * one, f"the other host's prompt took {other_seconds:.2f} s beside {flood}"


# -- metrics ------------------------------------------------------------------------------------------------


def _segments_on_metrics(worker: Worker) -> tuple[set[str], int]:
    with worker.client() as client:
        text = client.get("/metrics").text
    labels = {line.split('segment="', 1)[1].split('"', 1)[0] for line in text.splitlines() if 'segment="' in line}
    return labels, len(text.encode())


def test_client_chosen_segments_do_not_grow_metrics(worker: Worker):
    """Every segment was a label value on a dozen series: 2,000 of them grew /metrics from 18 KB to 1.3 MB. Past
    metrics.max_segments (5 here) new names are counted under _overflow, as the controller counts them. (2,000
    names: tests/worker/test_metrics.py, on WorkerMetrics itself; 400 here over HTTP.)"""
    first = [f"first-{i}" for i in range(MAX_SEGMENTS)]
    for segment in first:
        assert worker.post("/v1/completions", {"prompt": "hi", "max_tokens": 1, "segment": segment}).status_code == 200
    assert worker.complete("hi", max_tokens=1, segment="overflowing-0")["specd"]["segment"] == "overflowing-0"
    labels, size_before = _segments_on_metrics(worker)
    assert set(first) | {"_overflow"} <= labels <= set(first) | {"_overflow", "tenant-a"}  # tenant-a: the default
    overflowed = worker.metrics().total("specd_requests_total", segment="_overflow", status="finished")

    def run(names: list[str]) -> None:
        with worker.client() as client:
            for name in names:
                body = {"prompt": "hi", "max_tokens": 1, "segment": name}
                assert client.post("/v1/completions", json=body).status_code == 200

    names = [f"overflowing-{i}" for i in range(1, 400)]
    threads = [threading.Thread(target=run, args=(names[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    after, size_after = _segments_on_metrics(worker)
    assert after == labels, sorted(after)[:20]
    assert size_after <= size_before * 1.05, (size_before, size_after)  # the counts grow, not the label set
    requests = worker.metrics().total("specd_requests_total", segment="_overflow", status="finished")
    assert requests == overflowed + 399, "every overflowing request is still counted"
