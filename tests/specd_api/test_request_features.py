"""RequestFeatures: Decide's inputs, built once by the worker, carried whole to the wire."""

from __future__ import annotations

import pytest

from controller.serving.validation import request_from_proto
from specd_api.request_features import RequestFeatures
from specd_api.v1 import controller_pb2 as pb


def test_every_feature_reaches_its_field_of_the_decide_request():
    features = RequestFeatures(
        segment="code", batch_size=3, drafters=["draft", "suffix"], temperature=0.75, top_p=0.5, top_k=40,
        prompt_tokens=123, max_new_tokens=77, self_repetition=0.25,
    )  # fmt: skip
    assert features.drafters == ("draft", "suffix")  # a list is kept as a tuple
    assert features.to_proto() == pb.DecideRequest(
        segment="code", batch_size=3, drafters=["draft", "suffix"],
        sampling=pb.SamplingParams(temperature=0.75, top_p=0.5, top_k=40), prompt_tokens=123,
        prompt_features=pb.PromptFeatures(self_repetition=0.25), max_new_tokens=77,
    )  # fmt: skip


def test_the_controller_reads_them_under_the_same_learning_segment():
    for temperature, learned in ((0.0, "code"), (0.9, "code#sampled")):
        features = RequestFeatures("code", 2, ("prompt_lookup",), temperature=temperature, max_new_tokens=9)
        assert features.learning_segment == learned
        request = request_from_proto(features.to_proto())
        assert (request.segment, request.batch_size, request.drafters, request.max_new_tokens) == (
            learned, 2, ("prompt_lookup",), 9,
        )  # fmt: skip


def test_a_value_the_wire_cannot_carry_raises_when_the_message_is_built():
    with pytest.raises(ValueError):
        RequestFeatures("code", 1, (), prompt_tokens=2**40).to_proto()
