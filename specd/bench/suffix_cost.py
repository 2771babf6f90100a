"""c(suffix): what one suffix-decoding proposal costs with the worker's cache at its full size, against a target step.

The cache (decoder/drafters/suffix_cache.py, the worker's default size unless told) is filled past its byte cap with
synthetic outputs over several segments: two in three are built from a few recurring templates (tool-call-like
records: long shared spans, branching where the values differ), one in three is random tokens (novel text: the most
nodes per token). Then one drafter per proposal context (a cached output's prefix, so matches are long and walks run
to K; its own text a 512-token prompt) proposes again and again, each call timed alone: the median and p99 of a
proposal in microseconds, and over the target step: ``c_suffix`` for a whole proposal (the bounded figure:
under 0.02) and ``c_suffix_per_token`` (the glossary's c, per proposed token).

    python -m specd.bench.suffix_cost --target-step-ms 20     # alone; benchmarks/decode_loop.py runs it with its step
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from decoder.drafters import SuffixCache, SuffixConfig, SuffixDrafter

SEGMENTS = 4  # more than 1 / max_segment_share: the segments together reach the cache's cap
PROPOSALS = 2000


@dataclass(frozen=True)
class SuffixCost:
    cache_bytes: int  # what the cache holds (as it counts them) when timed
    cache_cap: int
    cache_outputs: int
    k: int
    propose_us_median: float
    propose_us_p99: float
    tokens_per_proposal: float
    target_step_ms: float
    c_suffix: float  # a whole proposal / a target step
    c_suffix_per_token: float  # per proposed token / a target step (the glossary's c)


def synthetic_output(rng: random.Random, templates: list[list[int]], vocab: int) -> list[int]:
    if rng.random() < 1 / 3:
        return [rng.randrange(vocab) for _ in range(rng.randint(64, 256))]
    out: list[int] = []
    for _ in range(rng.randint(2, 6)):  # records of one template, values (every 8th token) drawn anew
        template = rng.choice(templates)
        out += [rng.randrange(vocab) if i % 8 == 7 else t for i, t in enumerate(template)]
    return out


def fill(cache: SuffixCache, vocab: int, rng: random.Random) -> None:
    """Add outputs round-robin over the segments until the cache is near its cap and evicting."""
    templates = [[rng.randrange(vocab) for _ in range(rng.randint(24, 64))] for _ in range(12)]
    added = 0
    while cache.stats().outputs == added or cache.bytes < 0.95 * cache.config.cache_bytes:
        cache.add(f"segment-{added % SEGMENTS}", synthetic_output(rng, templates, vocab))
        added += 1


def measure_suffix_cost(
    vocab: int, target_step_seconds: float, k: int = 8, config: SuffixConfig | None = None, seed: int = 0
) -> SuffixCost:
    rng = random.Random(seed)
    cache = SuffixCache(config or SuffixConfig())
    fill(cache, vocab, rng)
    prompt = [rng.randrange(vocab) for _ in range(512)]
    samples, proposed = [], 0
    drafters = []
    for held in cache.outputs()[-32:]:  # contexts: a prompt, then the first half of an output its segment holds
        context = torch.tensor([*prompt, *held.tokens[: len(held.tokens) // 2]])
        drafter = SuffixDrafter(cache.config, cache, held.segment)
        drafter.prefill(context)
        drafters.append((drafter, context))
    for n in range(PROPOSALS):
        drafter, context = drafters[n % len(drafters)]
        started = time.perf_counter_ns()
        draft = drafter.propose(context, k)
        samples.append((time.perf_counter_ns() - started) / 1e3)
        proposed += draft.num_tokens
    median = statistics.median(samples)
    per_token = proposed / len(samples)
    step_us = target_step_seconds * 1e6
    stats = cache.stats()
    return SuffixCost(
        cache_bytes=stats.bytes, cache_cap=cache.config.cache_bytes, cache_outputs=stats.outputs, k=k,
        propose_us_median=median, propose_us_p99=statistics.quantiles(samples, n=100)[98],
        tokens_per_proposal=per_token, target_step_ms=target_step_seconds * 1e3, c_suffix=median / step_us,
        c_suffix_per_token=median / max(per_token, 1e-9) / step_us,
    )  # fmt: skip


def describe(cost: SuffixCost) -> str:
    return (
        f"c(suffix) = {cost.c_suffix:.4f} of a target step per proposal ({cost.propose_us_median:.1f} us median, "
        f"p99 {cost.propose_us_p99:.1f} us, K={cost.k}, {cost.tokens_per_proposal:.1f} tokens proposed), "
        f"{cost.c_suffix_per_token:.4f} per token; cache {cost.cache_bytes / 2**20:.1f} of "
        f"{cost.cache_cap / 2**20:.0f} MiB, {cost.cache_outputs} outputs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-step-ms", type=float, required=True, help="one target step, to divide by")
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--cache-mib", type=float, default=64)
    args = parser.parse_args()
    config = SuffixConfig(cache_bytes=int(args.cache_mib * 2**20))
    cost = measure_suffix_cost(args.vocab, args.target_step_ms / 1e3, args.k, config)
    print(describe(cost))
    print(json.dumps(asdict(cost), indent=2))


if __name__ == "__main__":
    main()
