"""The worker's suffix cache over its real HTTP path: served outputs fill it per segment, and an output whose request
says ``share_outputs: false`` (or whose segment the config makes private) never enters it, so no other request's
suffix decoding can propose from it."""

from __future__ import annotations

import time

import pytest

from tests.worker.conftest import Worker

PROMPT = "the cache keeps what the worker served:"
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def suffix_worker(launcher) -> Worker:
    return launcher.start(
        "suffix", segment_classifier="none", default_segment="default",
        suffix={"depth": 8, "private_segments": ["private-*"]},
    )  # fmt: skip


def cached_outputs(worker: Worker) -> float:
    return worker.metrics().total("specd_suffix_cache_outputs")


def complete(worker: Worker, segment: str, **body: object) -> dict:
    return worker.complete(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, segment=segment, **body)


def test_an_opted_out_output_never_enters_the_cache_and_a_shared_one_does(suffix_worker, reference):
    before = cached_outputs(suffix_worker)
    complete(suffix_worker, "tenant-x", share_outputs=False)
    assert cached_outputs(suffix_worker) == before, "share_outputs: false, yet the output was cached"
    complete(suffix_worker, "private-tenant")
    assert cached_outputs(suffix_worker) == before, "a private segment's output was cached"
    complete(suffix_worker, "tenant-y")
    deadline = time.monotonic() + 10  # shared after the answer, once the worker is idle
    while cached_outputs(suffix_worker) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert cached_outputs(suffix_worker) == before + 1, "a shared output must be cached"
    assert suffix_worker.metrics().total("specd_suffix_cache_bytes") > 0


def test_suffix_decoding_proposes_from_its_segments_shared_outputs_only(suffix_worker, reference):
    """The same prompt again with suffix decoding: in the segment whose earlier output was shared, the proposals are
    that output (nearly every token accepted); where the earlier output was withheld, only the request's own text."""
    speculation = {"drafter": "suffix", "k": 8, "report": False}
    complete(suffix_worker, "withheld", share_outputs=False)
    complete(suffix_worker, "shared")
    alone = complete(suffix_worker, "withheld", speculation=speculation, share_outputs=False)
    helped = complete(suffix_worker, "shared", speculation=speculation)
    want = reference.greedy(PROMPT, MAX_TOKENS)
    for answer in (alone, helped):
        assert answer["specd"]["drafter"] == "suffix"
        assert answer["usage"]["completion_tokens"] == len(want), "suffix decoding changed the output"
    assert helped["choices"][0]["text"] == alone["choices"][0]["text"]
    assert helped["specd"]["num_accepted"] > alone["specd"]["num_accepted"] + 5, (
        f"the shared output did not help: {helped['specd']} vs {alone['specd']}"
    )


def test_an_output_is_shared_once_no_sequence_decodes(tiny_pair) -> None:
    # Sharing (like scoring and reporting) runs after the answer, once the decode loop is idle: beside a decode it
    # would take a core from one of the decode's threads.
    import asyncio

    from decoder.sampling import SamplingParams
    from decoder.worker.service import RequestSpec
    from tests.worker.conftest import in_process, service_config

    with in_process(service_config(tiny_pair)) as service:
        cache = service.engine.suffix_cache  # type: ignore[union-attr]

        def spec(max_new_tokens: int) -> RequestSpec:
            return RequestSpec(prompt_text=None, prompt_ids=[5, 9, 3, 7], max_new_tokens=max_new_tokens,
                               params=SamplingParams(), stop_strings=(), segment="shared")  # fmt: skip

        async def run(request: RequestSpec) -> None:
            async for _ in service.run_request(request):
                pass

        async def both() -> int:
            long = asyncio.ensure_future(run(spec(400)))
            await asyncio.sleep(0.05)
            await run(spec(4))  # done while the long one decodes
            during = cache.stats().outputs
            await long
            return during

        during = asyncio.run(both())
        assert during == 0, "an output was shared while another sequence decoded"
        deadline = time.monotonic() + 5
        while cache.stats().outputs < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert cache.stats().outputs == 2, "both outputs are shared once the decode loop is idle"
