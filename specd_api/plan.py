"""The plan: how one request speculates. One type for the controller (which makes it), the client library (which
falls back to one) and the worker (which runs it), and the rules all three share, each in one function.

A plan names a drafter, a K ceiling and a stop rule, and carries what the worker needs to choose K round by round
(``round_k``): the controller's per-position acceptance estimates, how much they weigh against the request's own
rounds, and the costs at the request's batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

from specd_api.position_tally import PositionTally
from specd_api.speedup import best_k, speedup_curve

if TYPE_CHECKING:
    from specd_api.v1 import controller_pb2 as pb

# What can speculate ("none" is always possible); chain: prompt lookup, the draft model when lookup finds no match;
# suffix: the most frequent continuation in the request's text and its segment's earlier outputs.
DRAFTERS = ("draft", "prompt_lookup", "chain", "suffix")
DRAFTER_NAMES = (*DRAFTERS, "none")
Source = Literal["controller", "table", "last_decision", "local_default", "request"]
Fallback = Literal["timeout", "unavailable", "error"]

# Reasons a plan can carry (the controller's learned ones, and the rules).
BATCH_RULE_REASON = "batch_size_above_threshold"
LOCAL_DEFAULT_REASON = "local_default"
REQUEST_REASON = "request_override"


@dataclass(frozen=True)
class Plan:
    """What to run for one request. ``k`` is the ceiling of every round; ``round_k`` picks each round's K."""

    drafter: str = "none"
    k: int = 0
    reason: str = ""
    policy_version: str = ""
    exploration: bool = False
    expected_speedup: float = 1.0
    stale: bool = (
        False  # the controller's statistics were stale, or this is not the controller's answer to this request
    )
    segment: str = ""
    stop_threshold: float = 0.0  # the draft model ends a round when its own probability of the next token is lower
    acceptance: tuple[float, ...] = ()  # a_i per position, the controller's estimate
    proposal: tuple[float, ...] = ()  # pi_i per position
    prior_strength: float = 0.0  # pseudo-rounds the estimates weigh against the request's own rounds
    cost_ratio: float = 0.0  # c at the request's batch size
    verify_cost: tuple[float, ...] = ()  # v(n), n = 0..k, at the request's batch size
    probe_rounds: int = 0  # rounds run at k before adapting (a probe observes every position)
    counterfactual_k: int = 0  # prompt lookup's would-be proposals scored per round (0: off)
    calibration: float = 1.0  # realised / model for this segment and drafter, already in expected_speedup
    # Where the worker got it: "controller" (Decide), "table" (the pushed decision tables), or a fallback when the
    # controller did not answer in time.
    source: Source = "controller"
    fallback: Fallback | None = None
    latency_s: float = 0.0

    @property
    def speculates(self) -> bool:
        return self.drafter != "none" and self.k > 0

    @property
    def adaptive(self) -> bool:
        """Does the plan carry estimates to choose K per round from (else every round runs at k)?"""
        return self.speculates and len(self.acceptance) >= self.k and len(self.verify_cost) > 0

    def to_proto(self) -> pb.Decision:
        from specd_api.v1 import controller_pb2 as pb

        return pb.Decision(
            drafter=self.drafter,
            k=self.k,
            reason=self.reason,
            policy_version=self.policy_version,
            exploration=self.exploration,
            expected_speedup=self.expected_speedup,
            stale=self.stale,
            segment=self.segment,
            stop_threshold=self.stop_threshold,
            acceptance=self.acceptance,
            proposal=self.proposal,
            prior_strength=self.prior_strength,
            cost_ratio=self.cost_ratio,
            verify_cost=self.verify_cost,
            probe_rounds=self.probe_rounds,
            counterfactual_k=self.counterfactual_k,
            calibration=self.calibration,
        )

    @property
    def model_speedup(self) -> float:
        """The speedup model's expectation before calibration (what realised speedups are checked against)."""
        return self.expected_speedup / self.calibration if self.calibration > 0 else self.expected_speedup

    @classmethod
    def from_proto(cls, msg: pb.Decision, latency_s: float = 0.0) -> Plan:
        return cls(
            drafter=msg.drafter,
            k=msg.k,
            reason=msg.reason,
            policy_version=msg.policy_version,
            exploration=msg.exploration,
            expected_speedup=msg.expected_speedup,
            stale=msg.stale,
            segment=msg.segment,
            stop_threshold=msg.stop_threshold,
            acceptance=tuple(msg.acceptance),
            proposal=tuple(msg.proposal),
            prior_strength=msg.prior_strength,
            cost_ratio=msg.cost_ratio,
            verify_cost=tuple(msg.verify_cost),
            probe_rounds=msg.probe_rounds,
            counterfactual_k=msg.counterfactual_k,
            calibration=msg.calibration if msg.calibration > 0 else 1.0,  # 0: a controller before calibration
            source="controller",
            latency_s=latency_s,
        )


def off(reason: str, policy_version: str = "", segment: str = "", expected_speedup: float = 1.0) -> Plan:
    """No speculation, for ``reason``."""
    return Plan("none", 0, reason, policy_version, expected_speedup=expected_speedup, segment=segment)


def batch_bucket(batch_size: int) -> int:
    """Costs are learned per bucket of batch sizes: 1, 2, 3-4, 5-8, 9-16, ... (a bucket is named by its top)."""
    bucket = 1
    while bucket < batch_size:
        bucket *= 2
    return bucket


def speculation_allowed(batch_size: int, max_batch_size: int) -> bool:
    """The batch rule (contract 6): speculation is off above ``max_batch_size`` sequences decoded together."""
    return batch_size <= max_batch_size


def local_plan(
    drafter: str,
    k: int,
    offered: Sequence[str],
    batch_size: int,
    max_batch_size: int,
    fallback: Fallback | None,
    latency_s: float = 0.0,
) -> Plan:
    """The plan when no controller answered: the batch rule first, then ``drafter`` at ``k`` if the worker can run
    it, else no speculation. Every round runs at ``k`` (nothing is known to adapt with)."""
    if not speculation_allowed(batch_size, max_batch_size):
        drafter, k, reason = "none", 0, BATCH_RULE_REASON
    else:
        reason = LOCAL_DEFAULT_REASON
        if drafter not in offered or k <= 0:
            drafter, k = "none", 0
    return Plan(drafter, k, reason, stale=True, source="local_default", fallback=fallback, latency_s=latency_s)


def fallback_plan(
    last: Plan | None,
    default: Plan,
    offered: Sequence[str],
    batch_size: int,
    max_batch_size: int,
    cause: Fallback,
    latency_s: float,
) -> Plan:
    """The plan when the controller did not answer in time: the segment's last plan if the worker can still run its
    drafter (the batch rule applies first), else the local default."""
    if last is not None and last.drafter in (*offered, "none") and speculation_allowed(batch_size, max_batch_size):
        return replace(last, stale=True, source="last_decision", fallback=cause, latency_s=latency_s, exploration=False)
    return local_plan(default.drafter, default.k, offered, batch_size, max_batch_size, cause, latency_s)


def worth_remembering(plan: Plan) -> bool:
    """A plan about the segment, not about one request: the controller's, not a probe, not the batch rule."""
    return plan.source in ("controller", "table") and not plan.exploration and plan.reason != BATCH_RULE_REASON


MAX_ADAPTED_ACCEPTANCE = 0.99  # a request's own luck never makes acceptance certain
OPTIMISM_Z = 1.28  # stop drafting only when even the upper 90% bound of the lift says it does not pay


def round_k(plan: Plan, observed: PositionTally, ceiling: int) -> int:
    """This round's K, at most ``ceiling`` (the plan's k cut to the request's budget), given ``observed``: the
    request's own rounds so far.

    A plan without estimates runs every round at the ceiling, and so does a probe for its first ``probe_rounds``
    rounds. Otherwise the plan's per-position acceptance is scaled by how this request has done against it: the
    lift = (accepted + s) / (expected + s), with ``expected`` what the estimates predicted for the positions this
    request verified and s = ``prior_strength`` pseudo-acceptances, so a few unlucky rounds move little and many
    move a lot, at every position (deeper positions are rarely verified, but a request that does badly early does
    badly late). K is the best of the speedup curve under that lift. A request stops drafting (K = 0, a plain
    step: it then learns nothing more) only when no K pays even under the lift's upper 90% bound (a gamma
    posterior, mean lift plus 1.28 of its spread); while the evidence is thin it keeps drafting.
    """
    ceiling = min(ceiling, plan.k)
    if ceiling <= 0 or not plan.adaptive or observed.rounds < plan.probe_rounds:
        return max(ceiling, 0)
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


def _best_under(plan: Plan, lift: float, ceiling: int) -> tuple[int, float]:
    acceptance = [min(a * lift, MAX_ADAPTED_ACCEPTANCE) for a in plan.acceptance[:ceiling]]
    return best_k(speedup_curve(acceptance, plan.proposal, ceiling, plan.cost_ratio, plan.verify_cost))
