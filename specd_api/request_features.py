"""What a worker tells the controller about one request when it asks for a plan: one type, built once by the worker
and passed whole through the client library (its decision tables and its Decide call) to the wire's DecideRequest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specd_api.modes import learning_segment

if TYPE_CHECKING:
    from specd_api.v1 import controller_pb2 as pb


@dataclass(frozen=True)
class RequestFeatures:
    """Decide's inputs for one request. ``batch_size``: the sequences decoded together when the request would
    speculate; ``drafters``: what the worker can run ("none" is implied); ``self_repetition``: the share of the
    prompt's trailing 3-grams found earlier in it (0..1)."""

    segment: str
    batch_size: int
    drafters: tuple[str, ...]
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    self_repetition: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafters", tuple(self.drafters))  # a list given is kept as it was then

    @property
    def learning_segment(self) -> str:
        """The segment its statistics are learned and its tables kept under (``specd_api.modes``)."""
        return learning_segment(self.segment, self.temperature)

    def to_proto(self) -> pb.DecideRequest:
        """The DecideRequest; raises (ValueError, TypeError) on a value the wire cannot carry (an int beyond
        int32)."""
        from specd_api.v1 import controller_pb2 as pb

        return pb.DecideRequest(
            segment=self.segment,
            batch_size=self.batch_size,
            drafters=list(self.drafters),
            sampling=pb.SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k),
            prompt_tokens=self.prompt_tokens,
            prompt_features=pb.PromptFeatures(self_repetition=self.self_repetition),
            max_new_tokens=self.max_new_tokens,
        )
