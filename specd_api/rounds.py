"""What an engine records of a request's rounds, as every worker reports them (specd_client.reports): each round
run, and each drafter scored counterfactually over the rounds. Plain dataclasses, torch-free, so that any engine builds
them and the client turns them into RoundsAggregate messages."""

from __future__ import annotations

from dataclasses import dataclass

from specd_api.position_tally import PositionTally


@dataclass(frozen=True, slots=True)
class RoundRecord:
    """One draft + verify round. Timings are this sequence's share when its round ran batched with others."""

    drafter: str  # "draft" | "prompt_lookup" | "chain" | "suffix" | "none"
    k: int  # the K this round ran with (the plan's ceiling, cut to the budget and chosen per round)
    num_drafted: int  # tokens actually proposed, <= k (prompt lookup may find fewer; a draft may stop early)
    num_accepted: int  # leading draft tokens kept, 0..num_drafted
    num_emitted: int  # tokens this round added to the output (accepted + bonus, cut at a stop)
    draft_seconds: float
    verify_seconds: float
    batch_size: int = 1  # sequences in the step this round ran in


@dataclass
class Scored:
    """A drafter that did not run, scored over rounds of one ceiling K (a RoundsAggregate with ``counterfactual``
    set)."""

    drafter: str
    k: int  # the rounds' ceiling: positions 0..k-1 were offered
    tally: PositionTally  # [k] per position
