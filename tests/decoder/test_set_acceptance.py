"""The set-acceptance drafter (benchmarks/set_acceptance.py): the cost studies' stand-in for a trained draft.

It must (1) be accepted at the α it is set to, (2) pay the draft model's cost, one draft forward per proposed token
as the draft model drafter does, and (3) leave the output the target's own. Float64 tiny models: no rounding can
flip an argmax, so the engine is exact and the recorded continuation is what every run emits.
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.kept_slots import decode_with
from benchmarks.set_acceptance import SetAcceptanceDrafter, corrupted, verified_acceptance
from decoder.drafters.base import NoDrafter
from decoder.drafters.draft_model import DraftModelDrafter
from decoder.sampling import SamplingParams
from tests.conftest import tiny_lm

PROMPTS = ["def parse(path):\n    with open(path) as f:", "The with statement is used to wrap", "SELECT name FROM t"]
NEW_TOKENS = 96


@pytest.fixture(scope="module")
def pair(tokenizer):
    return tiny_lm("llama", tokenizer, seed=0), tiny_lm("llama", tokenizer, seed=1, hidden=32, layers=1)


@pytest.fixture(scope="module")
def references(pair, tokenizer) -> list[tuple[list[int], torch.Tensor]]:
    """Per prompt: its ids, and prompt + the target's greedy continuation (the first, target-only pass)."""
    target, _ = pair
    out = []
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        emitted = decode_with(target, NoDrafter(), ids, 0, NEW_TOKENS).token_ids
        out.append((ids, torch.tensor(ids + emitted)))
    return out


# ---- corrupted: a pure function ---------------------------------------------------------------------------------

REFERENCE = torch.arange(200) % 3  # [200] over a vocabulary of 3: a corrupted token has two wrong values to take


@pytest.mark.parametrize(
    ("alpha", "why"),
    [
        (1.0, "α = 1 keeps every position"),
        (0.0, "α = 0 changes every position from start on, and only to another token"),
    ],
)
def test_corrupted_at_the_ends(alpha, why):
    out = corrupted(REFERENCE, start=20, alpha=alpha, vocab_size=3, seed=5)
    assert torch.equal(out[:20], REFERENCE[:20]), "the prompt is never touched"
    changed = out[20:] != REFERENCE[20:]
    assert bool(changed.all()) if alpha == 0.0 else not bool(changed.any()), why
    assert int(out.min()) >= 0 and int(out.max()) < 3


def test_corrupted_is_a_function_of_its_seed():
    a = corrupted(REFERENCE, 0, 0.5, 3, seed=1)
    assert torch.equal(a, corrupted(REFERENCE, 0, 0.5, 3, seed=1))
    assert not torch.equal(a, corrupted(REFERENCE, 0, 0.5, 3, seed=2))


@pytest.mark.parametrize("bad", [-0.1, 1.5])
def test_corrupted_refuses_an_alpha_outside_0_1(bad):
    with pytest.raises(ValueError, match="alpha"):
        corrupted(REFERENCE, 0, bad, 3, seed=0)


# ---- through the engine -----------------------------------------------------------------------------------------


def run(pair, references, alpha: float, k: int, seed: int = 0):
    """Every prompt once at (α, K): its results, and its drafters (to look at their draft caches)."""
    target, draft = pair
    results, drafters = [], []
    for i, (ids, reference) in enumerate(references):
        proposals = corrupted(reference, len(ids), alpha, target.vocab_size, seed=seed * 1000 + i)
        drafter = SetAcceptanceDrafter(draft, proposals)
        results.append(decode_with(target, drafter, ids, k, NEW_TOKENS))
        drafters.append(drafter)
    return results, drafters


@pytest.mark.parametrize(("alpha", "k"), [(0.3, 2), (0.7, 4), (0.9, 8)])
def test_measured_acceptance_is_the_set_alpha(pair, references, alpha, k):
    """Each verified position is an independent Bernoulli(α) trial (each position is verified once: then it is
    emitted), so accepted / verified over N of them has standard deviation sqrt(α(1 − α) / N). Runs are seeded,
    so the test is deterministic; the 4.5σ band is what a correct drafter stays inside for all but ~7 in a million
    seeds, and it is narrow enough here (N ≈ 150-600) to catch a drafter corrupting at rate α instead of 1 − α, or
    one whose set tokens are not the target's own."""
    accepted = verified = 0
    for seed in range(2):
        results, _ = run(pair, references, alpha, k, seed)
        for result in results:
            a, v = verified_acceptance(result.stats.rounds)
            accepted, verified = accepted + a, verified + v
    band = 4.5 * math.sqrt(alpha * (1 - alpha) / verified)
    assert verified > 100, f"only {verified} verified positions: the band would say nothing"
    assert abs(accepted / verified - alpha) <= band, f"α set {alpha}, measured {accepted}/{verified}, band ±{band:.3f}"


@pytest.mark.parametrize(("alpha", "k"), [(0.0, 3), (0.5, 4), (1.0, 4)])
def test_the_output_is_the_targets_own(pair, references, alpha, k):
    """The engine verifies whatever a drafter proposes: wrong proposals cost time, never tokens."""
    results, _ = run(pair, references, alpha, k)
    for result, (ids, reference) in zip(results, references, strict=True):
        assert result.token_ids == reference[len(ids) :].tolist()
    drafted = sum(r.stats.num_drafted for r in results)
    accepted = sum(r.stats.num_accepted for r in results)
    if alpha == 1.0:
        assert accepted == drafted > 0, "α = 1: every proposal is the target's own token"
    if alpha == 0.0:
        assert accepted == 0 < drafted, "α = 0: no proposal is"


def count_forwards(drafter: DraftModelDrafter) -> list[int]:
    """Record the width of every draft model forward ``drafter`` runs from now on."""
    widths: list[int] = []
    forward = drafter.seq.forward

    def counted(input_ids, logits_to_keep=0):
        widths.append(int(input_ids.shape[0]))
        return forward(input_ids, logits_to_keep)

    drafter.seq.forward = counted  # type: ignore[method-assign]
    return widths


def test_it_pays_one_draft_forward_per_proposed_token_like_the_draft_model(pair, references):
    """Per round, the draft model runs once per proposed token (the first pass feeds what its cache has not seen,
    each later one the token proposed before; the last proposal is never fed). Against the draft model drafter
    itself, drafting with the target (α = 1 by construction: float64, so every proposal is the target's own), at
    α = 1 with the same model: both propose the same K tokens a round from the same cache state, so their passes
    must match width for width."""
    target, _ = pair
    ids, reference = references[0]
    drafter = SetAcceptanceDrafter(target, corrupted(reference, len(ids), 1.0, target.vocab_size, seed=0))
    widths = count_forwards(drafter)
    result = decode_with(target, drafter, ids, 4, NEW_TOKENS)
    prefill = 1  # prefill() feeds the prompt but its last token, once
    assert len(widths) - prefill == result.stats.num_drafted > 0

    itself = DraftModelDrafter(target, SamplingParams(), None)
    real_widths = count_forwards(itself)
    real = decode_with(target, itself, ids, 4, NEW_TOKENS)
    assert real.stats.num_accepted == real.stats.num_drafted, "the target drafting for itself is always accepted"
    assert widths == real_widths


def test_the_draft_cache_keeps_what_was_accepted(pair, references):
    """After each round the draft's cache holds a prefix of the context (the rejected proposals rolled back), as
    the draft model drafter's does: its next round feeds only what it has not seen."""
    _, drafters = run(pair, references, 0.6, 4)
    for drafter, (_, reference) in zip(drafters, references, strict=True):
        cached = drafter.cached_ids
        assert drafter.seq.length == cached.shape[0]
        assert torch.equal(cached, reference[: cached.shape[0]])
