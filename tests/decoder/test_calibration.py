"""The worker's start-up cost calibration (decoder/calibration.py): every n = 0..max_k timed in several short
sequences, each round verifying exactly n drafts, the first round of each dropped."""

from __future__ import annotations

import pytest

from decoder.batch_engine import BatchEngine
from decoder.calibration import measure_costs
from specd_api.modes import sampling_mode
from tests.conftest import perturbed_copy, tiny_lm


@pytest.fixture(scope="module")
def engine(tokenizer) -> BatchEngine:
    target = tiny_lm("llama", tokenizer, seed=0)
    return BatchEngine(target, perturbed_copy(target, scale=0.1, seed=3), max_batch=2)


def test_every_n_is_measured_in_several_sequences_of_each_sampling_mode(engine: BatchEngine) -> None:
    sequences = measure_costs(engine, max_k=4, sequences=3, rounds=4)
    assert len(sequences) == 2 * 3 * 5  # greedy and sampled, n = 0..4, three sequences each
    by_n: dict[tuple[str, int], int] = {}
    for sequence in sequences:
        rounds = sequence.rounds
        assert len(rounds) == 3, "the first round of each sequence is dropped (one-off costs)"
        ns = {r.num_drafted for r in rounds}
        assert len(ns) == 1, "a sequence verifies one n throughout"
        n = ns.pop()
        assert all(r.k == n and r.batch_size == 1 and r.verify_seconds > 0 for r in rounds)
        assert all((r.drafter == "none") == (n == 0) for r in rounds)
        mode = sampling_mode(sequence.temperature)
        by_n[(mode, n)] = by_n.get((mode, n), 0) + 1
    assert by_n == {(mode, n): 3 for mode in ("greedy", "sampled") for n in range(5)}
    assert engine.free_slots == 2, "every sequence's slots were given back"


def test_without_a_draft_model_only_plain_steps(tokenizer) -> None:
    plain = BatchEngine(tiny_lm("llama", tokenizer, seed=0), None, max_batch=1)
    sequences = measure_costs(plain, max_k=4, sequences=2, rounds=3)
    assert len(sequences) == 2 * 2 and all(r.num_drafted == 0 for s in sequences for r in s.rounds)
