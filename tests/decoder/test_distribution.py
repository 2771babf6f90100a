"""Contract 1 with sampling: speculative sampling's output is distributed exactly as the target's.

On a tiny-vocabulary model the exact joint distribution of the first generated tokens can be computed
by enumeration, and the empirical distribution of speculative samples is tested against it. The same
test run with a wrong residual (sampling from p instead of max(0, p - q) after a rejection) must fail,
which shows the test has the power to catch the classic bug.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import decoder.acceptance
from decoder.drafters import DraftModelDrafter
from decoder.engine import SpeculativeDecoder
from decoder.models import from_objects
from decoder.sampling import SamplingParams, logits_to_probs
from decoder.stopping import StopRules
from decoder.tiny import build_model
from specd_api.plan import Plan

VOCAB = 6
PROMPT = [1, 4, 2, 5, 3]
NUM_TOKENS = 2  # joint distribution of the first two generated tokens: 36 cells
SAMPLES = 2000


@pytest.fixture(scope="module")
def small_vocab_pair():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))
    target = from_objects(build_model("llama", VOCAB, seed=0).double(), tokenizer, "target")
    draft = from_objects(build_model("llama", VOCAB, seed=1, hidden=32, layers=1).double(), tokenizer, "draft")
    return target, draft


def exact_joint(target, params: SamplingParams) -> np.ndarray:
    """P(x1, x2 | PROMPT) under the target, by enumeration."""
    prefixes = torch.tensor([[*PROMPT, x1] for x1 in range(VOCAB)])  # [VOCAB, len + 1]
    with torch.no_grad():
        logits = target.model(prefixes).logits.float()  # [VOCAB, len + 1, vocab]
    p1 = logits_to_probs(logits[0, -2:-1], params)[0]  # [vocab]  after the prompt
    p2 = logits_to_probs(logits[:, -1], params)  # [vocab(x1), vocab(x2)]
    return (p1[:, None] * p2).numpy().ravel()


def sampled_joint(decoder: SpeculativeDecoder, drafter: str, params: SamplingParams) -> np.ndarray:
    counts = np.zeros(VOCAB**NUM_TOKENS)
    rules = StopRules(max_new_tokens=NUM_TOKENS + 2)  # K = 3 in the first round: the residual path matters
    for seed in range(SAMPLES):
        p = SamplingParams(params.temperature, params.top_k, params.top_p, seed=seed)
        tokens = decoder.generate(PROMPT, drafter, 3, p, rules).token_ids[:NUM_TOKENS]
        counts[tokens[0] * VOCAB + tokens[1]] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    probs = probs.astype(np.float64) / probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0  # a token the target can never produce was sampled
    expected = probs * counts.sum()
    keep = expected >= 5  # pool the rare cells so the chi-square approximation holds
    observed, expected = counts[keep], expected[keep]
    if probs[~keep].sum() > 0:
        observed = np.append(observed, counts[~keep].sum())
        expected = np.append(expected, probs[~keep].sum() * counts.sum())
    expected *= observed.sum() / expected.sum()  # float rounding only; chisquare checks the totals agree
    return float(chisquare(observed, expected).pvalue)


CASES = [
    ("draft", SamplingParams(temperature=1.0)),
    ("draft", SamplingParams(temperature=0.7, top_p=0.9)),
    ("prompt_lookup", SamplingParams(temperature=1.0, top_k=4)),
]


@pytest.mark.parametrize(("drafter", "params"), CASES, ids=["draft-t1", "draft-t0.7-p0.9", "lookup-t1-k4"])
def test_speculative_sampling_matches_target_distribution(small_vocab_pair, drafter, params):
    target, draft = small_vocab_pair
    decoder = SpeculativeDecoder(target, draft)
    counts = sampled_joint(decoder, drafter, params)
    pvalue = chi_square_pvalue(counts, exact_joint(target, params))
    assert pvalue > 1e-3, f"samples do not follow the target distribution (chi-square p = {pvalue:.2e})"


def test_a_wrong_residual_is_detected(small_vocab_pair, monkeypatch):
    target, draft = small_vocab_pair
    monkeypatch.setattr(decoder.acceptance, "residual_distribution", lambda p, q, draft_token: p)
    params = SamplingParams(temperature=1.0)
    counts = sampled_joint(SpeculativeDecoder(target, draft), "draft", params)
    pvalue = chi_square_pvalue(counts, exact_joint(target, params))
    assert pvalue < 1e-3, f"the test cannot tell a wrong residual from the right one (p = {pvalue:.2e})"


def test_seeded_runs_are_reproducible(small_vocab_pair):
    target, draft = small_vocab_pair
    decoder = SpeculativeDecoder(target, draft)
    rules = StopRules(max_new_tokens=12)
    runs = [
        decoder.generate(PROMPT, "draft", 4, SamplingParams(temperature=1.0, seed=s), rules).token_ids
        for s in (42, 42, 43)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_the_enumeration_is_a_distribution(small_vocab_pair):
    joint = exact_joint(small_vocab_pair[0], SamplingParams(temperature=1.0))
    assert joint.sum() == pytest.approx(1.0) and len(list(itertools.product(range(VOCAB), repeat=2))) == joint.size


def stopping_pair(small_vocab_pair, threshold: float) -> SpeculativeDecoder:
    """A decoder whose draft rounds stop at the plan's confidence threshold."""
    target, draft = small_vocab_pair
    decoder = SpeculativeDecoder(target, draft)
    plan = Plan("draft", 3, stop_threshold=threshold)
    real = decoder._make_drafter
    decoder._make_drafter = lambda name, params, generator, _=None: real(name, params, generator, plan)  # type: ignore[method-assign]
    return decoder


@pytest.mark.parametrize("threshold", [0.3, 0.5])
def test_a_draft_stopped_by_its_confidence_stays_exact(small_vocab_pair, threshold):
    # The stop rule looks at the draft's distribution (its most likely token's probability), never at the token
    # it samples, so shorter drafts keep the target's distribution.
    decoder = stopping_pair(small_vocab_pair, threshold)
    params = SamplingParams(temperature=1.0)
    counts = sampled_joint(decoder, "draft", params)
    pvalue = chi_square_pvalue(counts, exact_joint(small_vocab_pair[0], params))
    assert pvalue > 1e-3, f"a stopped draft changed the distribution (chi-square p = {pvalue:.2e})"
    # and the rule really stopped rounds short (else this test proves nothing)
    rules = StopRules(max_new_tokens=NUM_TOKENS + 2)
    stats = [decoder.generate(PROMPT, "draft", 3, SamplingParams(1.0, seed=s), rules).stats for s in range(50)]
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
    decoder = stopping_pair(small_vocab_pair, 0.3)
    params = SamplingParams(temperature=1.0)
    pvalue = chi_square_pvalue(sampled_joint(decoder, "draft", params), exact_joint(small_vocab_pair[0], params))
    assert pvalue < 1e-3, f"the test cannot tell the biased stop rule from the exact one (p = {pvalue:.2e})"
