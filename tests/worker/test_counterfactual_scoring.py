"""Suffix decoding scored counterfactually by the worker (decoder/worker/service.py): over the requests the plan asks
it for, on ``suffix.counterfactual_share`` of them, after the answer, with the segment's cache as the request found
it: the request's own output joins the cache only once it is scored. In process, with a stand-in for the controller
client that hands out the plan and keeps the reports."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from decoder.drafters import SuffixCache
from decoder.engine import SpeculativeDecoder
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from decoder.worker.config import WorkerConfig
from decoder.worker.service import RequestSpec, WorkerService
from specd_api.plan import Plan
from specd_api.request_features import RequestFeatures

SEGMENT = "scored"
PROMPT = [5, 9, 3, 7, 11, 5, 9, 3, 7, 11, 5, 9]  # repeats: prompt lookup, which serves it, finds matches
MAX_NEW_TOKENS = 24
SUFFIX_K = 16


class Client:
    """The controller client as the worker uses it: ``decide`` answers with ``plan``, ``report`` keeps the reports."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.reports: list[dict[str, Any]] = []

    def decide(self, request: RequestFeatures) -> Plan:
        return self.plan

    def report(self, **report: Any) -> None:
        self.reports.append(report)

    def close(self, flush_timeout_s: float) -> None:
        pass


def serve(service: WorkerService, count: int) -> None:
    spec = RequestSpec(prompt_text=None, prompt_ids=PROMPT, max_new_tokens=MAX_NEW_TOKENS, params=SamplingParams(),
                       stop_strings=(), segment=SEGMENT)  # fmt: skip

    async def one() -> None:
        async for event in service.run_request(spec):
            assert event.kind != "error", event

    for _ in range(count):
        asyncio.run(one())


def suffix_scores(report: dict[str, Any]) -> list[tuple[int, int, list[int], list[int], list[int]]]:
    return [(t.k, t.tally.rounds, t.tally.proposed, t.tally.verified, t.tally.accepted)
            for t in report["scored"] if t.drafter == "suffix"]  # fmt: skip


@pytest.fixture(scope="module")
def scored_worker(tiny_pair):
    config = WorkerConfig(
        target=tiny_pair.target, draft=None, device="cpu", dtype="float64", threads=1, max_batch=2, warm_up=False,
        segment_classifier="none", telemetry={"exporter": "none"}, controller={"address": None},
        suffix={"depth": 8, "counterfactual_share": 0.5},
    )  # fmt: skip
    service = WorkerService(config)
    service.startup()
    plan = Plan("prompt_lookup", 4, "best_expected_speedup", segment=SEGMENT,
                counterfactual_ks=(("prompt_lookup", 10), ("suffix", SUFFIX_K)))  # fmt: skip
    client = Client(plan)
    service.client = client  # type: ignore[assignment]
    try:
        serve(service, 4)
    finally:
        service.shutdown()  # waits for the scoring thread
    return service, client


def test_suffix_is_scored_on_its_share_of_requests_with_the_cache_as_the_request_found_it(scored_worker):
    service, client = scored_worker
    assert service.engine is not None
    target, config = service.engine.target, service.engine.suffix_cache.config
    rules = StopConditions(MAX_NEW_TOKENS, target.eos_token_ids)
    output = SpeculativeDecoder(target).generate(PROMPT, "none", 0, SamplingParams(), rules).token_ids
    assert len(client.reports) == 4
    scored = [suffix_scores(r) for r in client.reports]
    assert [bool(s) for s in scored] == [True, False, True, False], "the first request asked, then one in two"
    assert all(t.drafter != "prompt_lookup" for r in client.reports for t in r["scored"]), "lookup ran: not scored"

    def replayed(*cached: list[int]) -> list[tuple[int, int, list[int], list[int], list[int]]]:
        cache = SuffixCache(config)
        for tokens in cached:
            cache.add(SEGMENT, tokens)
        found = SpeculativeDecoder(target, suffix_cache=cache).score({"suffix": SUFFIX_K}, PROMPT, output, rules,
                                                                     SEGMENT)  # fmt: skip
        return [(t.k, t.tally.rounds, t.tally.proposed, t.tally.verified, t.tally.accepted) for t in found]

    # The first request found the cache empty; scored with its own output in it, it would accept nearly every token.
    assert scored[0] == replayed() != replayed(output)
    assert scored[2] == replayed(output, output)  # the first two requests' outputs, shared
    assert service.engine.suffix_cache.stats().outputs == 4, "every output is shared, the scored ones after scoring"
