"""Contract 1 with sampling, end to end: completions a `specd worker` samples over HTTP, speculating, follow the
target's exact distribution.

The worker serves the 6-token pair of tests/decoder/distribution.py, saved to disk: the target, and a perturbed copy
of it as the draft model, run at K=2 by the worker's default plan. Every request asks for 3 tokens at temperature 1
with its own seed, several in flight at once (batched, still speculating): its first round is a whole K=2 round,
bonus token included, and token 0 (the model's EOS) ends a completion early, often mid-round. The completions (the
tokens up to the first EOS) are tested against the exact enumeration.

The same sampler, pointed at an in-process worker (the same config file, the app over an ASGI transport) with a
bug planted in acceptance, must fail: the test has the power to see a wrong bonus token over HTTP.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from decoder.models import LoadedModel
from decoder.sampling import SamplingParams
from decoder.worker.app import build_app
from decoder.worker.config import load_worker_config
from decoder.worker.service import WorkerService
from tests.conftest import perturbed_copy
from tests.decoder.distribution import (
    PROMPT,
    REJECT_BELOW,
    Outcome,
    chi_square_pvalue,
    exact_distribution,
    plant,
    small_vocab_lm,
    small_vocab_tokenizer,
)
from tests.worker.conftest import Worker, WorkerLauncher

SAMPLES = 400
IN_FLIGHT = 8  # requests at once: batches of up to 8, the worker's speculation_max_batch, so every step speculates
MAX_TOKENS = 3
K = 2
EOS = 0  # the tiny models' config names token 0 as EOS


@dataclass(frozen=True)
class SixVocabPair:
    settings: dict[str, Any]  # the worker's config, over tests/worker/conftest.py's BASE_CONFIG
    target: LoadedModel  # the same target, in-process, for the enumeration


@pytest.fixture(scope="module")
def six_vocab_pair(tmp_path_factory) -> SixVocabPair:
    tokenizer = small_vocab_tokenizer()
    target = small_vocab_lm(tokenizer, 0, "target")
    draft = perturbed_copy(target, scale=0.3, seed=3)  # accepts most K=2 rounds whole, not all
    root = tmp_path_factory.mktemp("six-vocab")
    for name, lm in (("target", target), ("draft", draft)):
        lm.model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    settings = {
        "target": str(root / "target"), "draft": str(root / "draft"), "segment_classifier": "none",
        "controller": {"default_drafter": "draft", "default_k": K},
    }  # fmt: skip
    return SixVocabPair(settings, target)


@pytest.fixture(scope="module")
def six_vocab_worker(launcher: WorkerLauncher, six_vocab_pair: SixVocabPair) -> Iterator[Worker]:
    worker = launcher.start("six-vocab", **six_vocab_pair.settings)
    yield worker
    launcher.stop(worker)


@dataclass
class Completions:
    outcomes: list[Outcome]
    whole_rounds: int  # completions of one fully accepted K=2 round: 2 accepted drafts and the bonus token


async def sample_completions(client: httpx.AsyncClient) -> Completions:
    """SAMPLES completions of PROMPT (as token ids), IN_FLIGHT at a time, each with its own seed."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def one(seed: int) -> dict[str, Any]:
        body = {
            "prompt": list(PROMPT),
            "max_tokens": MAX_TOKENS,
            "temperature": 1.0,
            "seed": seed,
            "speculation": {"drafter": "draft", "k": K},
        }  # a seeded request runs target-only unless it names one
        async with gate:
            response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    answers = await asyncio.gather(*(one(seed) for seed in range(SAMPLES)))
    found = Completions([], 0)
    for answer in answers:
        choice, specd = answer["choices"][0], answer["specd"]
        tokens = tuple(int(word.removeprefix("t")) for word in choice["text"].split())  # token i reads "t{i}"
        assert len(tokens) == answer["usage"]["completion_tokens"], answer
        ended = ("stop", tokens.index(EOS) + 1) if EOS in tokens else ("length", MAX_TOKENS)
        assert (choice["finish_reason"], len(tokens)) == ended, answer
        assert (specd["drafter"], specd["k"]) == ("draft", K), specd
        found.outcomes.append(tokens)
        found.whole_rounds += len(tokens) == MAX_TOKENS and specd["num_rounds"] == 1  # K = 2 accepted, and the bonus
    return found


def pvalue(target: LoadedModel, completions: Completions) -> float:
    exact = exact_distribution(target, PROMPT, SamplingParams(temperature=1.0), MAX_TOKENS, frozenset({EOS}))
    return chi_square_pvalue(completions.outcomes, exact)


def test_completions_over_http_match_the_target_distribution(six_vocab_pair, six_vocab_worker):
    before = six_vocab_worker.metrics()

    async def run() -> Completions:
        async with httpx.AsyncClient(base_url=six_vocab_worker.url, timeout=60) as client:
            return await sample_completions(client)

    completions = asyncio.run(run())
    p = pvalue(six_vocab_pair.target, completions)
    assert p > REJECT_BELOW, f"the worker's completions do not follow the target's distribution (p = {p:.2e})"
    # What the test claims to exercise: speculation in batches, whole rounds with their bonus token, and EOS.
    after = six_vocab_worker.metrics()
    assert after.steps_above(1) - before.steps_above(1) > 0, "no step ran more than one sequence"
    assert completions.whole_rounds >= SAMPLES // 4, f"{completions.whole_rounds} whole K=2 rounds"
    assert sum(len(o) < MAX_TOKENS for o in completions.outcomes) >= SAMPLES // 10, "EOS hardly ever ended one"


def test_a_wrong_bonus_token_is_detected_over_http(six_vocab_pair, launcher, monkeypatch):
    plant(monkeypatch, "bonus-from-position-k-1")  # the worker below runs in this process: the bug is in its engine
    service = WorkerService(load_worker_config(launcher.config("six-vocab-in-process", **six_vocab_pair.settings)))
    service.startup()

    async def run() -> Completions:
        transport = httpx.ASGITransport(app=build_app(service))
        async with httpx.AsyncClient(transport=transport, base_url="http://worker", timeout=60) as client:
            return await sample_completions(client)

    try:
        completions = asyncio.run(run())
    finally:
        service.shutdown()
    p = pvalue(six_vocab_pair.target, completions)
    assert p < REJECT_BELOW, f"the HTTP test cannot tell a bonus token from the wrong position (p = {p:.2e})"
