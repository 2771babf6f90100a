"""What the distribution tests share (a helper module, not a test file): models over a 6-token vocabulary, the
target's exact distribution over its first generated tokens by enumeration, a chi-square test of samples against it,
and the planted bugs whose detection shows a test has the power it claims.

On a 6-token vocabulary every continuation of n tokens can be scored in one forward pass over the 6^(n-1) heads,
so the exact distribution of a whole round (the accepted drafts and the bonus token) is a small table.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

import decoder.acceptance
import decoder.engine
from decoder.acceptance import Verdict
from decoder.models import LoadedModel, from_objects
from decoder.sampling import SamplingParams, logits_to_probs
from decoder.tiny import build_model

VOCAB = 6
PROMPT = (1, 4, 2, 5, 3)
REJECT_BELOW = 1e-3  # a p-value under this is a failed match; the planted bugs must land under it

Outcome = tuple[int, ...]  # the first generated tokens (cut after a stop token when one came first)


def small_vocab_tokenizer() -> Any:
    """Token i is the word "t{i}"; decoded ids are the words joined by spaces."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))


def small_vocab_lm(tokenizer: Any, seed: int, name: str, hidden: int = 64, layers: int = 2) -> LoadedModel:
    """A random float64 Llama over the 6-token vocabulary (its config names token 0 as EOS)."""
    return from_objects(build_model("llama", VOCAB, seed=seed, hidden=hidden, layers=layers).double(), tokenizer, name)


def exact_distribution(
    target: LoadedModel,
    prompt: Iterable[int],
    params: SamplingParams,
    num_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
) -> dict[Outcome, float]:
    """P(first ``num_tokens`` generated tokens | prompt) under the target, by enumeration.

    A continuation that emits a token of ``stop_ids`` ends there: its outcome is cut after that token, and the
    probabilities of every continuation sharing that cut are summed.
    """
    prompt = list(prompt)
    vocab = target.vocab_size
    heads = list(itertools.product(range(vocab), repeat=num_tokens - 1))  # every x_1 .. x_{n-1}
    ids = torch.tensor([[*prompt, *head] for head in heads])  # [V^(n-1), len + n - 1]
    with torch.no_grad():
        logits = target.model(ids).logits[:, len(prompt) - 1 :]  # [V^(n-1), n, vocab]: after the prompt, after x_<i
    probs = logits_to_probs(logits.reshape(-1, vocab), params).double().reshape(len(heads), num_tokens, vocab)
    table: dict[Outcome, float] = {}
    for head, rows in zip(heads, probs.tolist(), strict=True):
        lead = math.prod(rows[i][token] for i, token in enumerate(head))  # P(x_1 .. x_{n-1})
        for last, p_last in enumerate(rows[-1]):
            outcome = cut_at_stop((*head, last), stop_ids)
            table[outcome] = table.get(outcome, 0.0) + lead * p_last
    return table


def exact_after_first(
    target: LoadedModel,
    prompt: Iterable[int],
    params: SamplingParams,
    num_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
) -> dict[Outcome, float]:
    """P(the ``num_tokens`` generated after the first | prompt), the first summed out: the first token is the
    prefill's (a plain draw, decoder/engine.py), so a request's rounds begin with the second, and a test of what
    rounds emit reads the tokens after it. A first token of ``stop_ids`` ends the request: outcome ()."""
    table: dict[Outcome, float] = {}
    for outcome, p in exact_distribution(target, prompt, params, num_tokens + 1, stop_ids).items():
        rest = outcome[1:]
        table[rest] = table.get(rest, 0.0) + p
    return table


def cut_at_stop(tokens: Iterable[int], stop_ids: frozenset[int]) -> Outcome:
    """``tokens`` up to and including the first stop token."""
    out: list[int] = []
    for token in tokens:
        out.append(token)
        if token in stop_ids:
            break
    return tuple(out)


def chi_square_pvalue(samples: Iterable[Outcome], probs: Mapping[Outcome, float]) -> float:
    """Pearson's chi-square p-value of ``samples`` against ``probs``; 0 when an impossible outcome was sampled."""
    counts = Counter(samples)
    if any(probs.get(outcome, 0.0) <= 0.0 for outcome in counts):
        return 0.0  # an outcome the target can never produce was sampled
    outcomes = sorted(probs)
    observed_all = np.array([counts[o] for o in outcomes], dtype=np.float64)
    p = np.array([probs[o] for o in outcomes], dtype=np.float64)
    p /= p.sum()
    total = observed_all.sum()
    keep = p * total >= 5  # pool the rare cells so the chi-square approximation holds
    observed, expected = observed_all[keep], p[keep] * total
    if p[~keep].sum() > 0:
        observed = np.append(observed, observed_all[~keep].sum())
        expected = np.append(expected, p[~keep].sum() * total)
    expected *= observed.sum() / expected.sum()  # float rounding only; chisquare checks the totals agree
    return float(chisquare(observed, expected).pvalue)


# -- planted bugs: each replaces one function the decode loop calls, for a test to show it would notice ---------------


def residual_is_p(p: torch.Tensor, q: torch.Tensor | None, draft_token: int) -> torch.Tensor:
    """After a rejection the replacement is drawn from p instead of norm(max(0, p - q)) (the classic bug)."""
    return p


def bonus_from_previous_position(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """After a fully accepted round the bonus token is drawn from p at position K-1 instead of K."""
    k = draft_tokens.shape[0]
    shifted = target_probs.clone()  # [k + 1, vocab]; row k is read only for the bonus token
    if k > 0:
        shifted[k] = target_probs[k - 1]
    return decoder.acceptance.rejection_sample(draft_tokens, draft_probs, shifted, generator)


def keeps_the_rejected_token(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """An off-by-one at the first rejection: the rejected draft token is kept, then the replacement follows it."""
    verdict = decoder.acceptance.rejection_sample(draft_tokens, draft_probs, target_probs, generator)
    if verdict.num_accepted < draft_tokens.shape[0]:
        return Verdict(verdict.num_accepted + 1, verdict.next_token)
    return verdict


# name -> (module, attribute, replacement): decoder.engine calls rejection_sample through its own import of it
PLANTED_BUGS: dict[str, tuple[ModuleType, str, Callable[..., Any]]] = {
    "residual-is-p": (decoder.acceptance, "residual_distribution", residual_is_p),
    "bonus-from-position-k-1": (decoder.engine, "rejection_sample", bonus_from_previous_position),
    "keeps-the-rejected-token": (decoder.engine, "rejection_sample", keeps_the_rejected_token),
}


def plant(monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    """Put the planted bug named ``bug`` in place until the test ends."""
    module, attribute, replacement = PLANTED_BUGS[bug]
    monkeypatch.setattr(module, attribute, replacement)
