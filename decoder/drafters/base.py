"""The one drafter interface. "No speculation" is a drafter that proposes nothing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from specd_api.plan import Plan, round_k
from specd_api.position_tally import PositionTally

if TYPE_CHECKING:
    from decoder.drafters.draft_model import DraftModelDrafter


@dataclass(frozen=True, slots=True)
class Draft:
    """Tokens proposed for one round; possibly none."""

    tokens: torch.Tensor  # [k] int64 on CPU, 0 <= k <= the K asked for
    probs: torch.Tensor | None = None  # [k, vocab] the drafter's q_i when it sampled; None = one-hot q

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


EMPTY_TOKENS = torch.empty(0, dtype=torch.long)


class KSchedule:
    """How many tokens a drafter proposes each round: the plan's rule (``specd_api.plan.round_k``) over the
    request's own rounds so far. Without a plan every round runs at the ceiling it is given."""

    def __init__(self, plan: Plan | None = None) -> None:
        self.plan = plan
        self.observed = PositionTally()  # the request's own rounds so far

    def next_k(self, ceiling: int) -> int:
        return ceiling if self.plan is None else round_k(self.plan, self.observed, ceiling)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.observed.add(num_drafted, num_accepted)


class Drafter(ABC):
    """Proposes up to K next tokens for one sequence.

    A drafter is made per sequence and may keep state (a KV cache) between rounds. Each round the engine asks
    ``next_k`` for this round's K (at most the ceiling the plan and the budget allow), calls ``propose`` with the
    whole context (prompt + everything emitted), then ``rollback`` with the context as verification left it, so
    a drafter with a cache drops its rejected tokens right away, and ``update`` with what the target kept: the
    feedback hook its K schedule adapts with (as transformers' ``update_candidate_strategy``).
    """

    name: ClassVar[str]
    schedule: KSchedule | None = None  # set per sequence by ``adapt``; None: every round at the ceiling

    def adapt(self, plan: Plan | None) -> None:
        """Choose K per round by ``plan``'s rule from now on."""
        self.schedule = KSchedule(plan)

    def next_k(self, ceiling: int) -> int:
        """This round's K, at most ``ceiling``."""
        return ceiling if self.schedule is None else self.schedule.next_k(ceiling)

    def update(self, num_drafted: int, num_accepted: int) -> None:
        """After verification: ``num_accepted`` of the ``num_drafted`` proposed tokens were kept."""
        if self.schedule is not None:
            self.schedule.observe(num_drafted, num_accepted)

    def prefill(self, context: torch.Tensor) -> None:  # noqa: B027 (a no-op is the right default)
        """Process the prompt ahead of the first round.  # context: [t] int64 on CPU"""

    @abstractmethod
    def propose(self, context: torch.Tensor, k: int) -> Draft:
        """Up to ``k`` tokens to follow ``context``.  # context: [t] int64 on CPU"""

    def rollback(self, context: torch.Tensor) -> None:  # noqa: B027 (stateless drafters keep nothing)
        """After verification: forget whatever is not a prefix of the new ``context``.  # [t] int64 on CPU"""

    @property
    def draft_model(self) -> DraftModelDrafter | None:
        """The draft model this drafter runs, if any (an engine that pools KV slots gives its slot back)."""
        return None

    def drafts_with_model(self, context: torch.Tensor, k: int) -> bool:
        """Would ``propose(context, k)`` draft with ``draft_model`` this round? An engine that batches the draft
        model across sequences (``propose_together``) drafts those rounds itself, and calls ``propose`` for the
        others.  # context: [t] int64 on CPU"""
        return False


class NoDrafter(Drafter):
    """Plain decoding: every round is a single target step."""

    name = "none"

    def next_k(self, ceiling: int) -> int:
        return 0

    def propose(self, context: torch.Tensor, k: int) -> Draft:
        return Draft(EMPTY_TOKENS)
