"""The one drafter interface. "No speculation" is a drafter that proposes nothing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from decoder.tree import DraftTree


@dataclass(frozen=True, slots=True)
class Draft:
    """Tokens proposed for one round; possibly none. A chain of tokens, or a tree of them (``tree``: its tokens
    are ``tokens``, node by node; the target verifies every node in one pass, decoder/tree.py)."""

    tokens: torch.Tensor  # [k] int64 on CPU, 0 <= k <= the K asked for (a tree: its nodes, none deeper than K)
    probs: torch.Tensor | None = None  # [k, vocab] the drafter's q_i when it sampled; None = one-hot q
    tree: DraftTree | None = None  # chosen one-hot (probs None); None: ``tokens`` is a chain

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


EMPTY_TOKENS = torch.empty(0, dtype=torch.long)


class Drafter(ABC):
    """Proposes up to K next tokens for one sequence: it prefills, proposes and rolls back, nothing else.

    A drafter is made per sequence and may keep state (a KV cache) between rounds. Each round the engine calls
    ``propose`` with the whole context (prompt + everything emitted) and the round's K, then ``rollback`` with the
    context as verification left it, so a drafter with a cache drops its rejected tokens right away. Which K a round
    runs, and what the target kept, are the sequence's round policy's (``specd_api.round_policy``).
    """

    name: ClassVar[str]

    def prefill(self, context: torch.Tensor) -> None:  # noqa: B027 (a no-op is the right default)
        """Process the prompt ahead of the first round.  # context: [t] int64 on CPU"""

    @abstractmethod
    def propose(self, context: torch.Tensor, k: int) -> Draft:
        """Up to ``k`` tokens to follow ``context``.  # context: [t] int64 on CPU"""

    def rollback(self, context: torch.Tensor) -> None:  # noqa: B027 (stateless drafters keep nothing)
        """After verification: forget whatever is not a prefix of the new ``context``.  # [t] int64 on CPU"""

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The target layers whose entering states this drafter reads (``observe``); none for most drafters."""
        return ()

    def observe(self, states: torch.Tensor) -> None:  # noqa: B027 (only a head reads the target's states)
        """The target's states (at ``feature_layers``) of the tokens its last pass kept, in context order: every
        context token's but the last, over the rounds.  # states: [m, layers * hidden]"""

    def drafts_with_model(self, context: torch.Tensor, k: int) -> bool:
        """Would ``propose(context, k)`` draft with its draft model this round (``draft_model_of``)? An engine that
        batches the draft model across sequences (``propose_together``) drafts those rounds itself, and calls
        ``propose`` for the others.  # context: [t] int64 on CPU"""
        return False


class NoDrafter(Drafter):
    """Plain decoding: every round is a single target step."""

    name = "none"

    def propose(self, context: torch.Tensor, k: int) -> Draft:
        return Draft(EMPTY_TOKENS)
