"""KV slots kept from one request to the next, as a worker keeps its pools, for benchmarks that run the engine's
single-sequence loop (``DecodeSession.step``).

A pass that captures per pool (the graphs pass captures each bucket's CUDA graph the first time its store runs it)
would pay its captures inside every request a benchmark times if each request had a pool of its own.
``SpeculativeDecoder.decode`` keeps its pools too (``decoder.kv_cache.SparePools``); the benchmarks time requests
through these slots, with a drafter they make themselves (the set-acceptance drafter, say): the same loop, the same
tokens, steady-state costs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from decoder.drafters.base import Drafter
from decoder.engine import DecodeSession, GenerationResult
from decoder.kv_cache import ModelSequence
from decoder.models import LoadedModel
from decoder.request_stop import StopConditions
from decoder.runners import KVPool
from decoder.runners.pool import PooledSequence
from decoder.sampling import SamplingParams
from specd_api.plan import requested
from specd_api.round_policy import RoundPolicy


def decode_with(
    target: LoadedModel,
    drafter: Drafter,
    prompt_ids: list[int],
    k: int,
    max_new_tokens: int,
    target_sequence: ModelSequence | None = None,
) -> GenerationResult:
    """One greedy request through the engine's own round loop (``DecodeSession``: draft, verify, accept, roll back)
    with ``drafter`` at ceiling ``k`` every round and no EOS (exactly ``max_new_tokens``), as
    ``SpeculativeDecoder.decode`` runs one with a drafter it makes itself; in ``target_sequence`` if given (else a
    fresh pool's)."""
    plan = requested(drafter.name, k)
    rules = StopConditions(max_new_tokens=max_new_tokens)
    policy = RoundPolicy.open(plan, drafter)
    session = DecodeSession(target, policy, prompt_ids, SamplingParams(), rules, None, target_sequence)
    session.prefill()
    while session.finish_reason is None:
        session.step()
    return session.result()


class KeptSlots:
    """One KV slot of the target's and one of the draft's, lent to one request at a time."""

    def __init__(self, target: LoadedModel, draft: LoadedModel | None) -> None:
        self.target_pool = KVPool(target, 1)
        self.draft_pool = KVPool(draft, 1) if draft is not None else None

    @contextmanager
    def lend(self, with_draft: bool) -> Iterator[tuple[PooledSequence, PooledSequence | None]]:
        """The target's slot, and the draft's when ``with_draft``, emptied; given back when the block ends."""
        target_seq = self.target_pool.open()
        draft_seq = self.draft_pool.open() if with_draft and self.draft_pool is not None else None
        try:
            yield target_seq, draft_seq
        finally:
            self.target_pool.release(target_seq)
            if draft_seq is not None:
                assert self.draft_pool is not None
                self.draft_pool.release(draft_seq)
