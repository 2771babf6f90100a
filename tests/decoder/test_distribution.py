"""Contract 1 with sampling: speculative sampling's output is distributed exactly as the target's.

On a tiny-vocabulary model the exact joint distribution of the first generated tokens can be computed by
enumeration (tests/decoder/distribution.py), and the empirical distribution of speculative samples is tested
against it. Two views:

* the first two tokens of a K=3 round, with drafts that are often rejected: the residual path;
* every token of a K=2 round, the bonus token after full acceptance included, with a draft that agrees with the
  target often: the bonus path.

Each view is also run with a bug planted (tests/decoder/distribution.py): a wrong residual in the first, the bonus
token drawn from the previous position in the second. It must fail then, which shows the test has the power to catch
that bug. (The rejected draft token kept by an off-by-one is test_batch_distribution.py's to catch.)
"""

from __future__ import annotations

import pytest
import torch

from decoder.drafters import DraftModelDrafter
from decoder.engine import SpeculativeDecoder
from decoder.models import LoadedModel
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams, logits_to_probs
from specd_api.plan import Plan, requested
from tests.conftest import perturbed_copy
from tests.decoder.distribution import (
    PROMPT,
    REJECT_BELOW,
    Outcome,
    chi_square_pvalue,
    exact_after_first,
    plant,
    small_vocab_lm,
    small_vocab_tokenizer,
)

# The first generated token is the prefill's (a plain draw); rounds begin with the second. The tests read the tokens
# after the first, against their distribution with the first summed out (exact_after_first).
NUM_TOKENS = 2  # joint distribution of the two tokens after the first: 36 cells
SAMPLES = 1000
ROUND_K = 2  # a whole round: K = 2 drafts and the bonus token, 216 cells
ROUND_SAMPLES = 400
PLAIN_SAMPLES = 300


@pytest.fixture(scope="module")
def small_vocab_pair() -> tuple[LoadedModel, LoadedModel]:
    tokenizer = small_vocab_tokenizer()
    return small_vocab_lm(tokenizer, 0, "target"), small_vocab_lm(tokenizer, 1, "draft", hidden=32, layers=1)


@pytest.fixture(scope="module")
def near_draft(small_vocab_pair) -> LoadedModel:
    """The target with noise on its weights: about two first rounds of K=2 in three are fully accepted."""
    return perturbed_copy(small_vocab_pair[0], scale=0.3, seed=3)


def sampled_joint(decoder: SpeculativeDecoder, drafter: str | Plan, params: SamplingParams) -> list[Outcome]:
    """Samples of the tokens after the first, ``drafter`` at K = 3 (or the plan given)."""
    rules = StopConditions(max_new_tokens=NUM_TOKENS + 3)  # K = 3 in the first round: the residual path matters
    plan = drafter if isinstance(drafter, Plan) else requested(drafter, 3)
    samples = []
    for seed in range(SAMPLES):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed)
        samples.append(tuple(decoder.decode(list(PROMPT), p, rules, plan).token_ids[1 : 1 + NUM_TOKENS]))
    return samples


def exact_joint(target: LoadedModel, params: SamplingParams, num_tokens: int = NUM_TOKENS) -> dict[Outcome, float]:
    return exact_after_first(target, PROMPT, params, num_tokens)


CASES = [
    ("draft", SamplingParams(temperature=1.0)),
    ("draft", SamplingParams(temperature=0.7, top_p=0.9)),
    ("prompt_lookup", SamplingParams(temperature=1.0, top_k=4)),
    # the first round is the draft model's (the prompt repeats no token), later ones often lookup's: q, then one-hot
    ("chain", SamplingParams(temperature=1.0)),
]


@pytest.mark.parametrize(("drafter", "params"), CASES, ids=["draft-t1", "draft-t0.7-p0.9", "lookup-t1-k4", "chain-t1"])
def test_speculative_sampling_matches_target_distribution(small_vocab_pair, drafter, params):
    target, draft = small_vocab_pair
    decoder = SpeculativeDecoder(target, draft)
    pvalue = chi_square_pvalue(sampled_joint(decoder, drafter, params), exact_joint(target, params))
    assert pvalue > REJECT_BELOW, f"samples do not follow the target distribution (chi-square p = {pvalue:.2e})"


def test_a_wrong_residual_is_detected(small_vocab_pair, monkeypatch):
    target, draft = small_vocab_pair
    plant(monkeypatch, "residual-is-p")
    params = SamplingParams(temperature=1.0)
    samples = sampled_joint(SpeculativeDecoder(target, draft), "draft", params)
    pvalue = chi_square_pvalue(samples, exact_joint(target, params))
    assert pvalue < REJECT_BELOW, f"the test cannot tell a wrong residual from the right one (p = {pvalue:.2e})"


# -- every token of a round, the bonus token included ------------------------------------------------------------


def sampled_rounds(decoder: SpeculativeDecoder) -> tuple[list[Outcome], float]:
    """The K + 1 tokens of the first round (after the prefill's token) of ROUND_SAMPLES seeded requests, and the share
    of those rounds that were fully accepted (so ended with a bonus token drawn from p_K)."""
    rules = StopConditions(max_new_tokens=ROUND_K + 2)  # the first round runs at K = 2 and can emit all 3 tokens
    samples, full = [], 0
    for seed in range(ROUND_SAMPLES):
        params = SamplingParams(temperature=1.0, seed=seed)
        result = decoder.generate(list(PROMPT), "draft", ROUND_K, params, rules)
        first = result.stats.rounds[0]
        assert first.k == first.num_drafted == ROUND_K, first
        full += first.num_accepted == first.num_drafted
        samples.append(tuple(result.token_ids[1:]))
    return samples, full / ROUND_SAMPLES


def test_every_token_of_a_round_matches_target_distribution(small_vocab_pair, near_draft):
    target = small_vocab_pair[0]
    samples, full_share = sampled_rounds(SpeculativeDecoder(target, near_draft))
    pvalue = chi_square_pvalue(samples, exact_joint(target, SamplingParams(temperature=1.0), ROUND_K + 1))
    assert pvalue > REJECT_BELOW, f"a round's tokens do not follow the target's distribution (p = {pvalue:.2e})"
    # Both ends of a round are exercised: the bonus token after full acceptance, and the residual after a rejection.
    assert 0.5 <= full_share <= 0.9, f"{full_share:.0%} of the rounds were fully accepted"


def test_a_bonus_token_from_the_wrong_position_is_detected(small_vocab_pair, near_draft, monkeypatch):
    target = small_vocab_pair[0]
    plant(monkeypatch, "bonus-from-position-k-1")
    samples, _ = sampled_rounds(SpeculativeDecoder(target, near_draft))
    pvalue = chi_square_pvalue(samples, exact_joint(target, SamplingParams(temperature=1.0), ROUND_K + 1))
    assert pvalue < REJECT_BELOW, f"the round test cannot tell the bonus token's position (p = {pvalue:.2e})"


def test_plain_sampling_matches_the_enumeration(small_vocab_pair):
    # The reference checked against itself: the target alone (no drafter) samples what the enumeration says, so a
    # wrong position in the enumeration cannot pass for a speculative bug, nor hide one.
    target = small_vocab_pair[0]
    decoder = SpeculativeDecoder(target)
    rules = StopConditions(max_new_tokens=ROUND_K + 2)
    samples = [
        tuple(decoder.generate(list(PROMPT), "none", 0, SamplingParams(temperature=1.0, seed=s), rules).token_ids[1:])
        for s in range(PLAIN_SAMPLES)
    ]
    pvalue = chi_square_pvalue(samples, exact_joint(target, SamplingParams(temperature=1.0), ROUND_K + 1))
    assert pvalue > REJECT_BELOW, f"the target's own samples disagree with the enumeration (p = {pvalue:.2e})"


def test_seeded_runs_are_reproducible(small_vocab_pair):
    target, draft = small_vocab_pair
    decoder = SpeculativeDecoder(target, draft)
    rules = StopConditions(max_new_tokens=12)
    runs = [
        decoder.generate(list(PROMPT), "draft", 4, SamplingParams(temperature=1.0, seed=s), rules).token_ids
        for s in (42, 42, 43)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# -- draft rounds stopped by the draft's confidence ------------------------------------------------------------------


def stopping_plan(threshold: float) -> Plan:
    """The draft model at K = 3, its rounds stopped at the plan's confidence threshold."""
    return Plan("draft", 3, stop_threshold=threshold)


@pytest.mark.parametrize("threshold", [0.3, 0.5])
def test_a_draft_stopped_by_its_confidence_stays_exact(small_vocab_pair, threshold):
    # The stop rule looks at the draft's distribution (its most likely token's probability), never at the token
    # it samples, so shorter drafts keep the target's distribution.
    decoder, plan = SpeculativeDecoder(*small_vocab_pair), stopping_plan(threshold)
    params = SamplingParams(temperature=1.0)
    pvalue = chi_square_pvalue(sampled_joint(decoder, plan, params), exact_joint(small_vocab_pair[0], params))
    assert pvalue > REJECT_BELOW, f"a stopped draft changed the distribution (chi-square p = {pvalue:.2e})"
    # and the rule really stopped rounds short (else this test proves nothing)
    rules = StopConditions(max_new_tokens=NUM_TOKENS + 2)
    stats = [decoder.decode(list(PROMPT), SamplingParams(1.0, seed=s), rules, plan).stats for s in range(50)]
    assert any(r.num_drafted < r.k for st in stats for r in st.rounds)


def test_stopping_on_the_sampled_tokens_own_probability_is_detected(small_vocab_pair, monkeypatch):
    # The tempting rule, "drop a drafted token whose probability is low", biases the proposals towards likely
    # tokens; rejection sampling with q then over-produces them. The test must see that.
    def pick(self, logits):
        q = logits_to_probs(logits, self.params)
        token = torch.multinomial(q, 1, generator=self.generator)[0]
        if float(q[0, token]) < self.stop_threshold:
            return None
        return token, q

    monkeypatch.setattr(DraftModelDrafter, "pick", pick)
    decoder, plan = SpeculativeDecoder(*small_vocab_pair), stopping_plan(0.3)
    params = SamplingParams(temperature=1.0)
    pvalue = chi_square_pvalue(sampled_joint(decoder, plan, params), exact_joint(small_vocab_pair[0], params))
    assert pvalue < REJECT_BELOW, f"the test cannot tell the biased stop rule from the exact one (p = {pvalue:.2e})"
