"""The round policy: how one sequence speculates, round by round. The one place that answers "K for this round".

A sequence's policy is built from its plan when the sequence opens and lives as long as it does. It holds what the
plan decided (the drafter, made from the plan with its stop threshold; the K ceiling; the batch threshold) and the
request's own rounds so far, and each round answers with this round's K:

1. above the batch threshold, 0 (DESIGN contract 6, applied as the batch grows and shrinks, every round): the
   threshold is the plan's (the policy's, or the worker's, given by ``specd_api.plan.runnable`` to a plan that carries
   none); a plan without one has no batch rule;
2. the plan's ``plain_rounds`` rounds from round PLAIN_ROUNDS_FROM on, 0: plain steps in the request's own context,
   the segment's reference;
3. the ceiling: the plan's K (or a caller's own K for this round, ``Plan.k_schedule``), cut to the budget left;
4. under it, what the plan's per-position estimates choose against the request's own rounds (``adapted_k``).

Drafters only prefill, propose and roll back: the outcome of every round comes here (``observe``). Torch-free, so a
worker of any make, and the controller's simulation of one, run exactly the engine's rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from specd_api.plan import Plan, allows_batch
from specd_api.position_tally import PositionTally
from specd_api.speedup import best_k, speedup_curve

D = TypeVar("D")  # what proposes the sequence's tokens: the engine's Drafter; a drafter's name in a simulation

MAX_ADAPTED_ACCEPTANCE = 0.99  # a request's own luck never makes acceptance certain
OPTIMISM_Z = 1.28  # stop drafting only when even the upper 90% bound of the lift says it does not pay
# A plan's plain rounds start at this round (0-based): the first steps after the prefill run 20-60 % slower than the
# rest (two CPU cores, the reference pair), and the segment's reference must be a steady plain step, as most of a plain
# request's are. A request that ends before it times none.
PLAIN_ROUNDS_FROM = 4


@dataclass
class RoundPolicy(Generic[D]):
    """One sequence's plan, held whole, and its rounds so far. Build it with ``open``."""

    plan: Plan
    drafter: D  # made from the plan (its drafter, its stop threshold, its segment)
    observed: PositionTally = field(default_factory=PositionTally)  # the request's own rounds so far

    @classmethod
    def open(cls, plan: Plan, drafter: D) -> RoundPolicy[D]:
        """The policy of a sequence opening with ``plan``, under the plan's batch threshold (a worker resolves it
        before: ``specd_api.plan.runnable``)."""
        return cls(plan, drafter)

    @property
    def ceiling(self) -> int:
        """The plan's K ceiling: the most any round proposes (0 when the plan does not speculate)."""
        return max(self.plan.k, 0) if self.plan.drafter != "none" else 0

    @property
    def stop_threshold(self) -> float:
        """The round's stop rule: the draft model ends a round where its own confidence is under this (0: never)."""
        return self.plan.stop_threshold

    def speculates_at(self, batch_size: int) -> bool:
        """The batch rule: may this sequence draft in a batch of ``batch_size`` sequences decoded together?"""
        return allows_batch(self.plan, batch_size)

    def round_k(self, batch_size: int, budget: int) -> int:
        """This round's K, in a batch of ``batch_size`` sequences, with room for ``budget`` drafted tokens (what the
        output budget and the context leave: ``decoder.request_stop.draft_budget``)."""
        if not self.speculates_at(batch_size) or self.plain_round():
            return 0
        ceiling = self.ceiling
        if self.plan.k_schedule:
            ceiling = min(ceiling, self.plan.k_schedule[self.observed.rounds % len(self.plan.k_schedule)])
        return adapted_k(self.plan, self.observed, min(ceiling, budget))

    def plain_round(self) -> bool:
        """Is this round one of the plan's plain rounds (``plain_rounds`` of them, from PLAIN_ROUNDS_FROM on)?"""
        return PLAIN_ROUNDS_FROM <= self.observed.rounds < PLAIN_ROUNDS_FROM + self.plan.plain_rounds

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """A round of this sequence ended: ``num_accepted`` of its ``num_drafted`` proposed tokens were kept."""
        self.observed.add(num_drafted, num_accepted)


def adapted_k(plan: Plan, observed: PositionTally, ceiling: int) -> int:
    """The K at most ``ceiling`` (the plan's k cut to the round's budget; the caller cuts) that the plan's
    estimates choose, given ``observed``: the request's own rounds so far.

    A plan without estimates runs every round at the ceiling, and so does a probe for its first ``probe_rounds`` rounds
    that are not its plain rounds. Otherwise the plan's per-position acceptance is scaled by how this request has done
    against it: the lift = (accepted + s) / (expected + s), with ``expected`` what the estimates predicted for the
    positions this request verified and s = ``prior_strength`` pseudo-acceptances, so a few unlucky rounds move little
    and many move a lot, at every position (deeper positions are rarely verified, but a request that does badly early
    does badly late). K is the best of the speedup curve under that lift. A request stops drafting (K = 0, a plain step:
    it then learns nothing more) only when no K pays even under the lift's upper 90% bound (a gamma posterior, mean lift
    plus 1.28 of its spread); while the evidence is thin it keeps drafting.
    """
    if ceiling <= 0 or not plan.adaptive or drafting_rounds(plan, observed) < plan.probe_rounds:
        return max(ceiling, 0)
    assert ceiling <= plan.k, f"the ceiling ({ceiling}) is above the plan's k ({plan.k}): the caller must cut it"
    s = max(plan.prior_strength, 0.0)
    expected = sum(v * a for v, a in zip(observed.verified, plan.acceptance, strict=False))
    accepted = observed.num_accepted
    if expected + s <= 0:
        return ceiling
    lift = (accepted + s) / (expected + s)
    k, value = _best_under(plan, lift, ceiling)
    if value > 1.0:
        return k
    optimistic = lift + OPTIMISM_Z * (accepted + s) ** 0.5 / (expected + s)
    k, value = _best_under(plan, optimistic, ceiling)
    return k if value > 1.0 else 0


def drafting_rounds(plan: Plan, observed: PositionTally) -> int:
    """The request's rounds so far that were not the plan's plain rounds."""
    plain = min(max(observed.rounds - PLAIN_ROUNDS_FROM, 0), max(plan.plain_rounds, 0))
    return observed.rounds - plain


def _best_under(plan: Plan, lift: float, ceiling: int) -> tuple[int, float]:
    acceptance = [min(a * lift, MAX_ADAPTED_ACCEPTANCE) for a in plan.acceptance[:ceiling]]
    return best_k(speedup_curve(acceptance, plan.proposal, ceiling, plan.cost_ratio, plan.verify_cost))
