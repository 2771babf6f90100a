"""After a rejection, both KV caches hold exactly the accepted prefix, equal to a fresh computation."""

from __future__ import annotations

import torch

from decoder.engine import SpeculativeDecoder
from decoder.kv_cache import ModelSequence, open_sequence
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from specd_api.plan import requested
from tests.conftest import tiny_lm


def fresh_keys(lm, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Keys of every layer computed from scratch over ``tokens``."""
    seq = open_sequence(lm)
    seq.forward(tokens)
    return seq.cached_keys()


def assert_cache_holds(seq: ModelSequence, tokens: torch.Tensor) -> None:
    assert seq.length == tokens.shape[0]
    for got, expected in zip(seq.cached_keys(), fresh_keys(seq.lm, tokens), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_caches_hold_the_accepted_prefix_after_each_round(arch, tokenizer, target):
    draft = tiny_lm(arch, tokenizer, seed=11, hidden=32, layers=1)
    decoder = SpeculativeDecoder(target, draft)
    session = decoder.session(
        list(range(5, 25)), SamplingParams(), StopConditions(max_new_tokens=40), requested("draft", 4)
    )
    session.prefill()
    rejections = 0
    while session.finish_reason is None:
        session.step()
        last = session.stats.rounds[-1]
        rejections += last.num_accepted < last.num_drafted
        # Target: everything but the last token (the bonus token is fed at the head of the next round).
        assert_cache_holds(session.target, session.context[:-1])
        # Draft: verified tokens only. After a rejection that is all but the bonus token; after a fully
        # accepted round the last draft token was never fed either, so it may be one shorter.
        drafter = session.drafter
        held = drafter.seq.length
        expected_held = session.context.shape[0] - (2 if last.num_accepted == last.num_drafted else 1)
        assert held == expected_held or session.finish_reason is not None
        assert torch.equal(drafter.cached_ids, session.context[:held])
        assert_cache_holds(drafter.seq, session.context[:held])
    assert rejections > 0, "no round rejected anything: the rollback was never exercised"


def test_truncate_then_extend_matches_fresh(target):
    seq = open_sequence(target)
    tokens = torch.arange(3, 30)
    seq.forward(tokens)
    seq.truncate(10)
    assert_cache_holds(seq, tokens[:10])
    seq.forward(torch.tensor([99, 98]))
    assert_cache_holds(seq, torch.cat([tokens[:10], torch.tensor([99, 98])]))
