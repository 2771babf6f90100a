from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ...) -> None: ...

class PromptFeatures(_message.Message):
    __slots__ = ("self_repetition",)
    SELF_REPETITION_FIELD_NUMBER: _ClassVar[int]
    self_repetition: float
    def __init__(self, self_repetition: _Optional[float] = ...) -> None: ...

class DecideRequest(_message.Message):
    __slots__ = ("segment", "batch_size", "drafters", "sampling", "prompt_tokens", "prompt_features", "max_new_tokens")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FEATURES_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    segment: str
    batch_size: int
    drafters: _containers.RepeatedScalarFieldContainer[str]
    sampling: SamplingParams
    prompt_tokens: int
    prompt_features: PromptFeatures
    max_new_tokens: int
    def __init__(self, segment: _Optional[str] = ..., batch_size: _Optional[int] = ..., drafters: _Optional[_Iterable[str]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_tokens: _Optional[int] = ..., prompt_features: _Optional[_Union[PromptFeatures, _Mapping]] = ..., max_new_tokens: _Optional[int] = ...) -> None: ...

class Decision(_message.Message):
    __slots__ = ("drafter", "num_draft_tokens", "reason", "policy_version", "exploration", "expected_speedup", "stale", "segment")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPLORATION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    num_draft_tokens: int
    reason: str
    policy_version: str
    exploration: bool
    expected_speedup: float
    stale: bool
    segment: str
    def __init__(self, drafter: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., reason: _Optional[str] = ..., policy_version: _Optional[str] = ..., exploration: _Optional[bool] = ..., expected_speedup: _Optional[float] = ..., stale: _Optional[bool] = ..., segment: _Optional[str] = ...) -> None: ...

class RoundsAggregate(_message.Message):
    __slots__ = ("segment", "drafter", "num_draft_tokens", "rounds", "num_draft_tokens_proposed", "num_accepted", "verified_per_position", "accepted_per_position", "tokens_emitted", "draft_seconds", "verify_seconds", "batch_size", "temperature", "prompt_tokens", "self_repetition", "proposed_per_position")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_PROPOSED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKENS_EMITTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SELF_REPETITION_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_PER_POSITION_FIELD_NUMBER: _ClassVar[int]
    segment: str
    drafter: str
    num_draft_tokens: int
    rounds: int
    num_draft_tokens_proposed: int
    num_accepted: int
    verified_per_position: _containers.RepeatedScalarFieldContainer[int]
    accepted_per_position: _containers.RepeatedScalarFieldContainer[int]
    tokens_emitted: int
    draft_seconds: float
    verify_seconds: float
    batch_size: int
    temperature: float
    prompt_tokens: int
    self_repetition: float
    proposed_per_position: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, segment: _Optional[str] = ..., drafter: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., rounds: _Optional[int] = ..., num_draft_tokens_proposed: _Optional[int] = ..., num_accepted: _Optional[int] = ..., verified_per_position: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., tokens_emitted: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., batch_size: _Optional[int] = ..., temperature: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., self_repetition: _Optional[float] = ..., proposed_per_position: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportRoundsRequest(_message.Message):
    __slots__ = ("report_id", "worker_id", "aggregates")
    REPORT_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    AGGREGATES_FIELD_NUMBER: _ClassVar[int]
    report_id: str
    worker_id: str
    aggregates: _containers.RepeatedCompositeFieldContainer[RoundsAggregate]
    def __init__(self, report_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., aggregates: _Optional[_Iterable[_Union[RoundsAggregate, _Mapping]]] = ...) -> None: ...

class ReportRoundsResponse(_message.Message):
    __slots__ = ("rounds_accepted", "duplicate", "journaled")
    ROUNDS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    JOURNALED_FIELD_NUMBER: _ClassVar[int]
    rounds_accepted: int
    duplicate: bool
    journaled: bool
    def __init__(self, rounds_accepted: _Optional[int] = ..., duplicate: _Optional[bool] = ..., journaled: _Optional[bool] = ...) -> None: ...

class GetSegmentStatsRequest(_message.Message):
    __slots__ = ("segment",)
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    segment: str
    def __init__(self, segment: _Optional[str] = ...) -> None: ...

class PositionStats(_message.Message):
    __slots__ = ("position", "offered", "proposed", "verified", "accepted", "conditional_alpha", "alpha")
    POSITION_FIELD_NUMBER: _ClassVar[int]
    OFFERED_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    CONDITIONAL_ALPHA_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    position: int
    offered: float
    proposed: float
    verified: float
    accepted: float
    conditional_alpha: float
    alpha: float
    def __init__(self, position: _Optional[int] = ..., offered: _Optional[float] = ..., proposed: _Optional[float] = ..., verified: _Optional[float] = ..., accepted: _Optional[float] = ..., conditional_alpha: _Optional[float] = ..., alpha: _Optional[float] = ...) -> None: ...

class DrafterKStats(_message.Message):
    __slots__ = ("drafter", "num_draft_tokens", "rounds", "proposed", "accepted", "alpha", "alpha_ci_low", "alpha_ci_high", "mean_accepted_length", "expected_speedup")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    ALPHA_CI_LOW_FIELD_NUMBER: _ClassVar[int]
    ALPHA_CI_HIGH_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    num_draft_tokens: int
    rounds: float
    proposed: float
    accepted: float
    alpha: float
    alpha_ci_low: float
    alpha_ci_high: float
    mean_accepted_length: float
    expected_speedup: float
    def __init__(self, drafter: _Optional[str] = ..., num_draft_tokens: _Optional[int] = ..., rounds: _Optional[float] = ..., proposed: _Optional[float] = ..., accepted: _Optional[float] = ..., alpha: _Optional[float] = ..., alpha_ci_low: _Optional[float] = ..., alpha_ci_high: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., expected_speedup: _Optional[float] = ...) -> None: ...

class DrafterStats(_message.Message):
    __slots__ = ("drafter", "positions", "cost_ratio", "by_k")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COST_RATIO_FIELD_NUMBER: _ClassVar[int]
    BY_K_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    positions: _containers.RepeatedCompositeFieldContainer[PositionStats]
    cost_ratio: float
    by_k: _containers.RepeatedCompositeFieldContainer[DrafterKStats]
    def __init__(self, drafter: _Optional[str] = ..., positions: _Optional[_Iterable[_Union[PositionStats, _Mapping]]] = ..., cost_ratio: _Optional[float] = ..., by_k: _Optional[_Iterable[_Union[DrafterKStats, _Mapping]]] = ...) -> None: ...

class SegmentStats(_message.Message):
    __slots__ = ("segment", "drafters", "rounds", "last_update_unix", "decision", "stale")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATE_UNIX_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    segment: str
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterStats]
    rounds: float
    last_update_unix: float
    decision: Decision
    stale: bool
    def __init__(self, segment: _Optional[str] = ..., drafters: _Optional[_Iterable[_Union[DrafterStats, _Mapping]]] = ..., rounds: _Optional[float] = ..., last_update_unix: _Optional[float] = ..., decision: _Optional[_Union[Decision, _Mapping]] = ..., stale: _Optional[bool] = ...) -> None: ...

class ListSegmentsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSegmentsResponse(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentStats]
    def __init__(self, segments: _Optional[_Iterable[_Union[SegmentStats, _Mapping]]] = ...) -> None: ...

class GetPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadPolicyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PolicyInfo(_message.Message):
    __slots__ = ("version", "path", "text", "loaded_unix")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOADED_UNIX_FIELD_NUMBER: _ClassVar[int]
    version: str
    path: str
    text: str
    loaded_unix: float
    def __init__(self, version: _Optional[str] = ..., path: _Optional[str] = ..., text: _Optional[str] = ..., loaded_unix: _Optional[float] = ...) -> None: ...
