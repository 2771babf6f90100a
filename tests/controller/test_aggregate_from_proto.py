"""A report's aggregate is the wire message's fields under their own names: derived, not copied by hand."""

from __future__ import annotations

from dataclasses import fields

import pytest

from controller.decision.counts import Aggregate
from controller.serving.validation import AS_SENT, READ_HERE, aggregate
from specd_api.v1 import controller_pb2 as pb

WIRE = {f.name for f in pb.RoundsAggregate.DESCRIPTOR.fields}
# What the controller reads of the message under another shape: the two per-n lists become ``by_drafted``.
PAIRED = {"rounds_by_drafted", "verify_seconds_by_drafted"}


def test_every_field_of_the_aggregate_is_a_field_of_the_message_or_read_from_one():
    own = {f.name for f in fields(Aggregate)}
    assert own - WIRE == {"by_drafted"}, "a field the wire does not carry"
    assert WIRE - own == PAIRED, "a field the wire carries that the controller drops"
    assert set(AS_SENT) == own - READ_HERE


def served(**changes) -> pb.RoundsAggregate:
    fields_ = dict(
        segment="code", drafter="draft", k=2, rounds=4, num_drafted=6, num_accepted=3,
        proposed_per_position=[4, 2], verified_per_position=[4, 2], accepted_per_position=[2, 1],
        tokens_emitted=7, draft_seconds=0.004, verify_seconds=0.04, batch_size=3, temperature=0.0, prompt_tokens=50,
        self_repetition=0.25, rounds_by_drafted=[1, 0, 3], verify_seconds_by_drafted=[0.01, 0.0, 0.03],
        expected_speedup=1.4, request_tokens_emitted=9, request_seconds=0.05,
    )  # fmt: skip
    return pb.RoundsAggregate(**{**fields_, **changes})


def test_each_value_arrives_under_its_name():
    a = aggregate(served())
    assert (a.segment, a.drafter, a.k, a.rounds, a.num_drafted, a.num_accepted) == ("code", "draft", 2, 4, 6, 3)
    assert (a.proposed_per_position, a.verified_per_position, a.accepted_per_position) == ((4, 2), (4, 2), (2, 1))
    assert (a.tokens_emitted, a.draft_seconds, a.verify_seconds) == (7, pytest.approx(0.004), pytest.approx(0.04))
    assert (a.batch_size, a.prompt_tokens, a.self_repetition) == (3, 50, 0.25)
    assert a.by_drafted == ((1, pytest.approx(0.01)), (0, 0.0), (3, pytest.approx(0.03)))
    assert (a.expected_speedup, a.request_tokens_emitted) == (pytest.approx(1.4), 9)
    assert a.request_seconds == pytest.approx(0.05) and not a.counterfactual and not a.start_up_timings


def test_the_segment_is_learned_per_sampling_mode_except_start_up_timings():
    assert aggregate(served(temperature=0.8)).segment == "code#sampled"
    assert aggregate(served(temperature=0.8, start_up_timings=True)).segment == "code"


def test_served_rounds_without_their_per_n_timings_are_refused_by_name():
    with pytest.raises(ValueError, match="rounds_by_drafted"):
        aggregate(served(rounds_by_drafted=[], verify_seconds_by_drafted=[]))
    nothing = served(rounds=0, num_drafted=0, num_accepted=0, proposed_per_position=[], verified_per_position=[],
                     accepted_per_position=[], tokens_emitted=0, draft_seconds=0.0, verify_seconds=0.0,
                     rounds_by_drafted=[], verify_seconds_by_drafted=[], request_tokens_emitted=0,
                     request_seconds=0.0)  # fmt: skip
    assert aggregate(nothing).rounds == 0, "no rounds: nothing to time"
