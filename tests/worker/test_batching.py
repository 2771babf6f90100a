"""Continuous batching over HTTP: greedy requests sent together (so the worker decodes them in one batch, with
ragged acceptance) return exactly what each returns alone, and what the target alone decodes.

Each test checks in /metrics that batches of more than one sequence did happen: otherwise it would prove
nothing. Requests ask for different max_tokens, so they leave the batch one by one and the batch shrinks
while the others go on (and, above speculation_max_batch, speculation switches back on mid-request)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.worker.conftest import Metrics, Reference, Worker, WorkerLauncher

PROMPTS = [
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n",
    "SELECT name FROM users WHERE id = 1;",
    "Once upon a time there was",
    '{"name": "specd", "version": 1, "tags": ["a", "b"]}',
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "import os\nimport sys\n",
    "hello hello hello world",
]
MAX_TOKENS = [32, 80, 48, 72, 40, 64, 76, 56]


@pytest.fixture(scope="module")
def narrow_worker(launcher: WorkerLauncher) -> Iterator[Worker]:
    """Speculation only while at most 2 sequences share the batch."""
    worker = launcher.start("narrow", speculation_max_batch=2, controller={"default_drafter": "draft", "default_k": 3})
    yield worker
    launcher.stop(worker)


def outcome(body: dict[str, Any]) -> tuple[str, int, str]:
    choice = body["choices"][0]
    return choice["text"], body["usage"]["completion_tokens"], choice["finish_reason"]


def one_at_a_time(worker: Worker, count: int) -> list[dict[str, Any]]:
    return [worker.complete(p, max_tokens=n, temperature=0) for p, n in zip(PROMPTS[:count], MAX_TOKENS, strict=False)]


def all_at_once(worker: Worker, count: int) -> list[dict[str, Any]]:
    """The same requests from ``count`` threads released together."""
    bodies: list[dict[str, Any] | None] = [None] * count
    go = threading.Barrier(count)

    def send(i: int) -> None:
        go.wait()
        bodies[i] = worker.complete(PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(b is not None for b in bodies), "a request did not come back"
    return [b for b in bodies if b is not None]


def moved(before: Metrics, after: Metrics, name: str, **labels: str) -> float:
    return after.total(name, **labels) - before.total(name, **labels)


@pytest.mark.parametrize(("worker_name", "drafter"), [("draft_worker", "draft"), ("lookup_worker", "prompt_lookup")])
def test_batched_greedy_equals_one_at_a_time(request, worker_name: str, drafter: str, reference: Reference):
    worker: Worker = request.getfixturevalue(worker_name)
    count = len(PROMPTS)
    single = one_at_a_time(worker, count)
    before = worker.metrics()
    batched = all_at_once(worker, count)
    after = worker.metrics()

    assert after.steps_above(1) - before.steps_above(1) > 0, "no step decoded more than one sequence"
    assert after.steps_above(2) - before.steps_above(2) > 0, "no step decoded more than two sequences"
    assert max(b["specd"]["batch_size"] for b in batched) > 1
    # Speculation was on in the batch, and drafts were both accepted and rejected (ragged acceptance).
    assert all(b["specd"]["drafter"] == drafter for b in batched)
    proposed = moved(before, after, "specd_draft_tokens_total", drafter=drafter)
    accepted = moved(before, after, "specd_accepted_tokens_total", drafter=drafter)
    assert 0 < accepted < proposed, (accepted, proposed)

    assert [outcome(b) for b in batched] == [outcome(s) for s in single]
    for prompt, max_tokens, body in zip(PROMPTS, MAX_TOKENS, single, strict=True):
        ids = reference.greedy(prompt, max_tokens)
        assert outcome(body)[:2] == (reference.tokenizer.decode(ids, skip_special_tokens=True), len(ids)), prompt


@pytest.mark.parametrize("named", [{}, {"speculation": {"drafter": "draft", "k": 3}}], ids=["local", "named"])
def test_above_speculation_max_batch_the_output_is_the_same(narrow_worker: Worker, named: dict[str, Any]):
    """A long request starts alone (decided: draft), five shorter ones join it (the batch of six decodes
    without speculation), leave, and the long one speculates again on its own. The same for requests that name
    their own drafter and K: their plans carry no threshold, and the worker's applies to them."""
    lead, followers = ("The quick brown fox", 200), list(zip(PROMPTS[1:6], MAX_TOKENS[1:6], strict=True))
    worker = narrow_worker
    start = worker.metrics()
    single = [worker.complete(p, max_tokens=n, temperature=0, **named) for p, n in [lead, *followers]]
    before = worker.metrics()

    leading = InFlight(worker, lead, named)
    worker.wait_for(lambda: worker.health()["batch_size"] == 1, "the long request decoding")
    joined = [InFlight(worker, follower, named) for follower in followers]
    batched = [r.join() for r in (leading, *joined)]
    after = worker.metrics()

    assert [outcome(b) for b in batched] == [outcome(s) for s in single]
    above = after.steps_above(2) - before.steps_above(2)
    assert above > 0, "the batch never went above speculation_max_batch"
    # Above 2 sequences a round drafts nothing (counted as drafter "none"; alone, only a request's last round
    # can, when one token is left).
    plain_alone = moved(start, before, "specd_rounds_total", drafter="none")
    plain_batched = moved(before, after, "specd_rounds_total", drafter="none")
    assert plain_batched >= plain_alone + 3 * above
    long_one = batched[0]["specd"]
    assert long_one["drafter"] == "draft"  # decided alone; it shared the batch only part of the time
    assert long_one["num_drafted"] > single[0]["specd"]["num_drafted"] / 2 > 0


class InFlight:
    """A greedy completion sent from a thread."""

    def __init__(self, worker: Worker, request: tuple[str, int], extra: dict[str, Any] | None = None) -> None:
        self.body: dict[str, Any] | None = None
        prompt, max_tokens = request
        self.thread = threading.Thread(
            target=lambda: setattr(
                self, "body", worker.complete(prompt, max_tokens=max_tokens, temperature=0, **(extra or {}))
            )
        )
        self.thread.start()

    def join(self) -> dict[str, Any]:
        self.thread.join(120)
        assert self.body is not None, "the request did not come back"
        return self.body
