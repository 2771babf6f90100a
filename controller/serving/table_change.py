"""Is a recomputed decision table worth sending? A table moves a little at every decay step and prior refit (its
estimates are posterior means, its probe shares the counts of 64 draws), and sending 1,000 tables to 256 streams for
moves no worker's choice can feel costs more than computing them. A table is sent again only when it
differs from the one the streams hold by more than these tolerances: a plan (drafter, K, reason, flags, the policy's
settings) must be the same exactly; its estimates may differ by a little. The tolerance is against the table the
streams hold, not the last one computed, so that moves add up until they are sent. Pure functions.
"""

from __future__ import annotations

import math

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from specd_api.v1 import controller_pb2 as pb

# Probabilities (acceptance and proposal per position, the calibration factor near 1): this much apart, absolute.
# A worker choosing K per round from acceptances 0.01 apart picks the same K but at a tie.
PROBABILITY_TOLERANCE = 0.01
PROBABILITIES = frozenset({"acceptance", "proposal", "calibration"})
# Any other number (expected speedup, costs, the prior's weight): this share apart.
RELATIVE_TOLERANCE = 0.01
# A probe's share of a bucket's requests is the count of 64 draws (±0.06 at a share of 0.1): this much apart (a probe
# that comes or goes is a change, however small its share).
PROBE_SHARE_TOLERANCE = 0.05
_FLOATS = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)


def material_change(held: pb.SegmentTable, new: pb.SegmentTable) -> bool:
    """Does ``new`` differ from ``held`` by more than the tolerances (so that a worker holding ``held`` must get
    ``new``)?"""
    if _rules(held) != _rules(new):
        return True
    if not _close(held.prefill_cost_per_token, new.prefill_cost_per_token, "prefill_cost_per_token"):
        return True
    if len(held.buckets) != len(new.buckets) or held.HasField("above_max_batch_size") != new.HasField(
        "above_max_batch_size"
    ):
        return True
    if _plan_moved(held.above_max_batch_size, new.above_max_batch_size):
        return True
    return any(_bucket_moved(a, b) for a, b in zip(held.buckets, new.buckets, strict=True))


def _rules(table: pb.SegmentTable) -> tuple[str, int, int]:
    return table.segment, table.max_batch_size, table.min_new_tokens


def _bucket_moved(held: pb.BucketDecision, new: pb.BucketDecision) -> bool:
    if held.batch_bucket != new.batch_bucket or _plan_moved(held.plan, new.plan):
        return True
    held_probes = {p.plan.drafter: p for p in held.probes}
    new_probes = {p.plan.drafter: p for p in new.probes}
    if held_probes.keys() != new_probes.keys():  # a probe that comes or goes, however rare (the exploration floor,
        return True  # 0.02 by default, is below the share tolerance: a worker without the probe would never probe)
    for drafter, a in held_probes.items():
        b = new_probes[drafter]
        if not abs(a.probability - b.probability) <= PROBE_SHARE_TOLERANCE:  # (NaN: a change)
            return True
        if _plan_moved(a.plan, b.plan):
            return True
    return False


def _plan_moved(held: pb.Decision, new: pb.Decision) -> bool:
    """Any field of the plan apart: numbers beyond their tolerance, anything else at all (new fields included)."""
    for field in pb.Decision.DESCRIPTOR.fields:
        a, b = getattr(held, field.name), getattr(new, field.name)
        if field.type not in _FLOATS:
            if field.has_presence and held.HasField(field.name) != new.HasField(field.name):
                return True
            if _plain(a, field) != _plain(b, field):
                return True
        elif field.is_repeated:
            if len(a) != len(b) or not all(_close(x, y, field.name) for x, y in zip(a, b, strict=True)):
                return True
        elif not _close(a, b, field.name):
            return True
    return False


def _plain(value: object, field: FieldDescriptor) -> object:
    """A comparable form of a non-number field (a repeated or map field's containers compare by content)."""
    if isinstance(value, Message):
        return value.SerializeToString(deterministic=True)
    if field.is_repeated:
        return dict(value) if hasattr(value, "items") else list(value)  # type: ignore[call-overload]
    return value


def _close(a: float, b: float, name: str) -> bool:
    if not (math.isfinite(a) and math.isfinite(b)):
        return a == b or (math.isnan(a) and math.isnan(b))
    if name in PROBABILITIES:
        return abs(a - b) <= PROBABILITY_TOLERANCE
    return math.isclose(a, b, rel_tol=RELATIVE_TOLERANCE, abs_tol=1e-12)
