"""The worker's cost calibration at start-up: rounds that verify exactly n drafts, n = 0..max_k, timed before any
traffic, greedy and sampled (each sampling mode's costs are their own: a sampled round draws every drafted token and
softmaxes every verified position), so that the controller's first decisions price K with this machine's costs, not
the literature's defaults (v(n) = 1 + 0.02 n, a GPU's; on two CPU cores v(8) is about 2.5, and a cold controller drew
the draft model to long K).

Each n is measured in several short sequences, each one observation of the controller's median (a stall during
calibration is one rank among them, as in traffic). The first round of each sequence is dropped: it pays one-off
costs (the prefill's caches, a new shape). The rounds are reported as ``start_up_timings`` aggregates: counted in
the costs, in no segment. Online timings then confirm or move these figures as any others.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from decoder.batch_engine import BatchEngine
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from specd_api.plan import offers, requested
from specd_api.rounds import RoundRecord

CALIBRATION_SEGMENT = "_calibration"  # the segment field of the start_up_timings aggregates (no segment)
CALIBRATION_MAX_K = 8
SEQUENCES_PER_K = 4  # observations per n: a median of 4 survives one stalled sequence
ROUNDS_PER_SEQUENCE = 6  # the first is dropped
SAMPLED_TEMPERATURE = 1.0  # the sampled mode's calibration (its costs do not depend on the temperature)
CALIBRATION_SEED = 0


@dataclass(frozen=True)
class TimedSequence:
    """One calibration sequence's timed rounds, and the temperature they were decoded at (their sampling mode)."""

    temperature: float
    rounds: list[RoundRecord]


def calibration_prompt(vocab_size: int, length: int = 48) -> list[int]:
    """A prompt of ordinary token ids (none of the first few, which are often special)."""
    span = max(min(97, vocab_size - 3), 1)
    return [(i * 13) % span + 3 for i in range(length)]


def measure_costs(
    engine: BatchEngine, max_k: int = CALIBRATION_MAX_K, sequences: int = SEQUENCES_PER_K,
    rounds: int = ROUNDS_PER_SEQUENCE,
) -> list[TimedSequence]:  # fmt: skip
    """Timed rounds, one list per short sequence, greedy then sampled: plain steps (n = 0), then the draft model at
    K = 1..max_k (it proposes exactly K: no stop rule here), at batch 1. Without a draft model, only the plain
    steps."""
    drafter_ks: list[tuple[str, int]] = [("none", 0)]
    if offers(engine.drafters, "draft"):
        drafter_ks += [("draft", k) for k in range(1, max_k + 1)]
    prompt = calibration_prompt(engine.target.vocab_size)
    measured: list[TimedSequence] = []
    for params in (SamplingParams(), SamplingParams(temperature=SAMPLED_TEMPERATURE, seed=CALIBRATION_SEED)):
        for _ in range(sequences):
            for drafter, k in drafter_ks:
                timed = _sequence(engine, prompt, drafter, k, rounds, params)
                measured.append(TimedSequence(params.temperature, timed))
    return measured


def _sequence(
    engine: BatchEngine, prompt: Sequence[int], drafter: str, k: int, rounds: int, params: SamplingParams
) -> list[RoundRecord]:
    rules = StopConditions(max_new_tokens=(k + 1) * (rounds + 1) + 1)  # never cut by the budget: every round drafts k
    plan = requested(drafter, k, max_batch_size=1)  # at batch 1, whatever the worker's batch rule
    session = engine.open(list(prompt), params, rules, plan)
    try:
        for _ in range(rounds):
            if session.finish_reason is not None:
                break
            engine.step([session])
    finally:
        engine.close(session)
    return list(session.stats.rounds[1:])
