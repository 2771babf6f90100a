"""Decision tables: a segment's plans per batch bucket, pushed by the controller (WatchDecisions) so that a worker
decides locally, and the one rule that answers a request from them. Pure; proto messages are converted once, when
they arrive, so that a lookup is a dict access and a few comparisons.

A table holds the plan the controller would give a request of the segment at each batch bucket, with the probes it
would send instead on a share of them. It is made for a request at neutral features (the prior model's inputs) with
enough new tokens that no K is capped; ``plan_from_table`` answers only requests for which that plan is the
controller's answer too, and returns None for the others (ask Decide):

- a batch above the segment's ``max_batch_size`` gets the table's plan for it: no speculation (the batch rule);
- fewer new tokens than ``min_new_tokens``: K would be capped, or the request judged too short;
- a draft-model plan whose saving does not repay the draft's prefill of this prompt: Decide picks another arm;
- a bucket the table has no plan for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from specd_api.plan import Origin, Plan, batch_bucket, speculation_allowed
from specd_api.speedup import repays_prefill

if TYPE_CHECKING:
    from specd_api.v1 import controller_pb2 as pb


@dataclass(frozen=True)
class BucketEntry:
    plan: Plan
    probes: tuple[tuple[Plan, float], ...] = ()  # (probe, share of the bucket's requests), shares sum to <= 1


@dataclass(frozen=True)
class SegmentTable:
    segment: str
    max_batch_size: int
    min_new_tokens: int
    prefill_cost_per_token: float
    buckets: Mapping[int, BucketEntry]
    above_max_batch_size: Plan  # no speculation, with what the controller adds to it (e.g. counterfactual_ks)

    @classmethod
    def from_proto(cls, msg: pb.SegmentTable) -> SegmentTable:
        buckets = {
            b.batch_bucket: BucketEntry(
                Plan.from_proto(b.plan), tuple((Plan.from_proto(p.plan), p.probability) for p in b.probes)
            )
            for b in msg.buckets
        }
        return cls(
            msg.segment, msg.max_batch_size, msg.min_new_tokens, msg.prefill_cost_per_token, buckets,
            Plan.from_proto(msg.above_max_batch_size),
        )  # fmt: skip


def plan_from_table(
    table: SegmentTable, batch_size: int, max_new_tokens: int, prompt_tokens: int, draw: float
) -> Plan | None:
    """The controller's plan for this request from the segment's table, or None when the table cannot say (ask
    Decide). ``draw`` is uniform in [0, 1): it picks a probe with the probes' shares."""
    if not speculation_allowed(batch_size, table.max_batch_size):
        return table.above_max_batch_size
    entry = table.buckets.get(batch_bucket(batch_size))
    if entry is None or max_new_tokens < table.min_new_tokens:
        return None
    plan = _probe(entry, draw) or entry.plan
    if plan.exploration or not plan.speculates:
        return plan
    if not repays_prefill(
        plan.drafter, plan.expected_speedup, max_new_tokens, prompt_tokens, plan.cost_ratio,
        table.prefill_cost_per_token,
    ):  # fmt: skip
        return None
    return plan


def _probe(entry: BucketEntry, draw: float) -> Plan | None:
    total = 0.0
    for plan, share in entry.probes:
        total += share
        if draw < total:
            return plan
    return None


def as_local(plan: Plan, stale: bool, latency_s: float) -> Plan:
    """A table's plan as the worker runs it: where it came from, and whether the controller's view was stale."""
    return replace(plan, stale=plan.stale or stale, origin=Origin("table", None, latency_s))
