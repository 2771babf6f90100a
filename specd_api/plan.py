"""The plan: how one request speculates. One type for the controller (which makes it), the client library (which
falls back to one) and the worker (which runs it), and the rules all three share, each in one function.

A plan names a drafter, a K ceiling, a stop rule and the batch threshold, and carries what the worker needs to choose
K round by round: the controller's per-position acceptance estimates, how much they weigh against the request's own
rounds, and the costs at the request's batch size. The worker runs it through a round policy
(``specd_api.round_policy``), built from the plan when the sequence opens.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from specd_api.v1 import controller_pb2 as pb

# What can speculate ("none" is always possible); chain: prompt lookup, the draft model when lookup finds no match;
# suffix: the most frequent continuation in the request's text and its segment's earlier outputs; eagle: a draft
# head on the target's own hidden states.
DRAFTERS = ("draft", "prompt_lookup", "chain", "suffix", "eagle")
DRAFTER_NAMES = (*DRAFTERS, "none")
# The one-hot drafters a worker can score counterfactually: replayed over the tokens a request emitted whatever ran,
# for free (prompt lookup) or nearly (suffix decoding, on a share of requests).
SCORABLE = ("prompt_lookup", "suffix")
Source = Literal["controller", "table", "last_decision", "local_default", "request"]
Fallback = Literal["timeout", "unavailable", "error"]

# Reasons a plan can carry (the controller's learned ones, and the rules).
BATCH_RULE_REASON = "batch_size_above_threshold"
LOCAL_DEFAULT_REASON = "local_default"
REQUEST_REASON = "request_override"
SEEDED_REASON = "seeded_sampling"  # a seeded sampled request decodes without speculation (``seeded``)


@dataclass(frozen=True)
class Origin:
    """Where a worker got its plan and how long asking took: the worker's record, never on the wire. ``source``:
    "controller" (Decide), "table" (the pushed decision tables), "request" (the caller's own), or a fallback when
    the controller did not answer in time ("last_decision", "local_default", with the ``fallback`` cause)."""

    source: Source = "controller"
    fallback: Fallback | None = None
    latency_s: float = 0.0


@dataclass(frozen=True)
class Plan:
    """What to run for one request. ``k`` is the ceiling of every round; the round policy picks each round's K
    (``specd_api.round_policy``)."""

    drafter: str = "none"
    k: int = 0
    reason: str = ""
    policy_version: str = ""
    exploration: bool = False
    expected_speedup: float = 1.0
    stale: bool = False  # not made from the controller's fresh statistics: they were stale, or this is a fallback
    segment: str = ""
    stop_threshold: float = 0.0  # the draft model ends a round when its own probability of the next token is lower
    acceptance: tuple[float, ...] = ()  # a_i per position, the controller's estimate
    proposal: tuple[float, ...] = ()  # pi_i per position
    prior_strength: float = 0.0  # pseudo-rounds the estimates weigh against the request's own rounds
    cost_ratio: float = 0.0  # c at the request's batch size
    verify_cost: tuple[float, ...] = ()  # v(n), n = 0..k, at the request's batch size
    probe_rounds: int = 0  # rounds run at k before adapting (a probe observes every position)
    # (drafter, K ceiling) per drafter to score counterfactually over the request's rounds, by name; none: nothing.
    counterfactual_ks: tuple[tuple[str, int], ...] = ()
    calibration: float = 1.0  # realised / model for this segment and drafter, already in expected_speedup
    # The batch rule's threshold (contract 6): no speculation in a batch of more sequences than this, applied every
    # round. Set by whoever makes the plan: the controller (its policy's), a fallback (the worker's); a plan that
    # reaches a worker without one (a caller's own) gets the worker's in ``runnable``. None: no batch rule.
    max_batch_size: int | None = None
    # A caller's own K ceiling for each round in turn, cycled (warm-up, calibration, tests); never on the wire.
    # (): every round's ceiling is ``k``.
    k_schedule: tuple[int, ...] = ()
    # plain rounds run before the first that drafts: the segment's plain step in the request's context (a reference)
    plain_rounds: int = 0
    origin: Origin = Origin()  # where the worker got it (not on the wire)

    @property
    def speculates(self) -> bool:
        return self.drafter != "none" and self.k > 0

    def counterfactual_ceiling(self, drafter: str) -> int:
        """The K ``drafter`` is scored at over this request's rounds (0: not scored)."""
        return next((k for d, k in self.counterfactual_ks if d == drafter), 0)

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
            plain_rounds=self.plain_rounds,
            counterfactual_ks=dict(self.counterfactual_ks),
            calibration=self.calibration,
            max_batch_size=self.max_batch_size,
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
            plain_rounds=msg.plain_rounds,
            counterfactual_ks=counterfactual_ks(dict(msg.counterfactual_ks)),
            calibration=msg.calibration if msg.calibration > 0 else 1.0,  # 0: not set (proto3's default), none applied
            max_batch_size=msg.max_batch_size if msg.HasField("max_batch_size") else None,  # absent: not given
            origin=Origin("controller", None, latency_s),
        )


def counterfactual_ks(by_drafter: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """A plan's ``counterfactual_ks`` from a Decision's map: only positive ceilings, sorted by drafter."""
    return tuple(sorted((d, k) for d, k in by_drafter.items() if k > 0))


def requested(drafter: str, k: int, k_schedule: Sequence[int] = (), max_batch_size: int | None = None) -> Plan:
    """A caller's own plan (no controller asked): ``drafter`` at ceiling ``k`` every round, or at each ceiling of
    ``k_schedule`` in turn (each at most ``k``). No estimates: nothing adapts. ``max_batch_size``: None, the worker's
    batch threshold applies."""
    k = k if drafter != "none" else 0
    return Plan(
        drafter, k, REQUEST_REASON, origin=Origin("request"), k_schedule=tuple(k_schedule),
        max_batch_size=max_batch_size,
    )  # fmt: skip


def seeded() -> Plan:
    """The plan of a seeded sampled request that names no speculation: none. Rejection sampling draws from the
    request's generator as its drafter, each round's K and each step's batch rule (other requests' load) decide, so
    the same seed gives the same text only where none of those can vary: target-only decoding, one draw per token."""
    return Plan("none", 0, SEEDED_REASON, origin=Origin("request"))


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


def offers(offered: Collection[str], drafter: str) -> bool:
    """Can a worker that offers ``offered`` run ``drafter``? It can always run "none". The one test of it: the
    fallbacks here and the worker ask it, and the engine's ``drafters`` is what it offers."""
    return drafter == "none" or drafter in offered


def runnable(plan: Plan, offered: Collection[str], max_batch_size: int | None) -> Plan:
    """``plan`` as a worker that offers ``offered`` runs it: no speculation when it cannot run the plan's drafter,
    and the batch threshold in force, the plan's, else the worker's ``max_batch_size``. The one place a plan's
    threshold is resolved: the round policy applies the plan's and nothing else."""
    if plan.max_batch_size is None:
        plan = replace(plan, max_batch_size=max_batch_size)
    return plan if offers(offered, plan.drafter) else replace(plan, drafter="none", k=0, k_schedule=())


def local_plan(
    drafter: str,
    k: int,
    offered: Sequence[str],
    batch_size: int,
    max_batch_size: int,
    fallback: Fallback | None,
    latency_s: float = 0.0,
) -> Plan:
    """The plan when no controller answered: the batch rule at the worker's ``max_batch_size`` first, then
    ``drafter`` at ``k`` if the worker can run it, else no speculation. Every round runs at ``k`` (nothing is known
    to adapt with), under the worker's threshold."""
    if not speculation_allowed(batch_size, max_batch_size):
        drafter, k, reason = "none", 0, BATCH_RULE_REASON
    else:
        reason = LOCAL_DEFAULT_REASON
        if drafter == "none" or k <= 0 or not offers(offered, drafter):
            drafter, k = "none", 0
    origin = Origin("local_default", fallback, latency_s)
    return Plan(drafter, k, reason, stale=True, max_batch_size=max_batch_size, origin=origin)


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
    drafter and the batch is within the threshold in force, else the local default under it. The threshold is the
    last plan's (the policy's), else the worker's ``max_batch_size``."""
    if last is not None and last.max_batch_size is not None:
        max_batch_size = last.max_batch_size
    if last is not None and offers(offered, last.drafter) and speculation_allowed(batch_size, max_batch_size):
        return replace(
            last, max_batch_size=max_batch_size, stale=True, exploration=False,
            origin=Origin("last_decision", cause, latency_s),
        )  # fmt: skip
    return local_plan(default.drafter, default.k, offered, batch_size, max_batch_size, cause, latency_s)


def allows_batch(plan: Plan, batch_size: int) -> bool:
    """The batch rule at ``plan``'s own threshold (None: no rule)."""
    return plan.max_batch_size is None or speculation_allowed(batch_size, plan.max_batch_size)


def worth_remembering(plan: Plan) -> bool:
    """A plan about the segment, not about one request: the controller's, not a probe, not the batch rule."""
    return plan.origin.source in ("controller", "table") and not plan.exploration and plan.reason != BATCH_RULE_REASON
