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
    __slots__ = ("drafter", "k", "reason", "policy_version", "exploration", "expected_speedup", "stale", "segment", "stop_threshold", "acceptance", "proposal", "prior_strength", "cost_ratio", "verify_cost", "probe_rounds", "calibration", "max_batch_size", "counterfactual_ks", "plain_rounds")
    class CounterfactualKsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPLORATION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    STOP_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    PRIOR_STRENGTH_FIELD_NUMBER: _ClassVar[int]
    COST_RATIO_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COST_FIELD_NUMBER: _ClassVar[int]
    PROBE_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    COUNTERFACTUAL_KS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    k: int
    reason: str
    policy_version: str
    exploration: bool
    expected_speedup: float
    stale: bool
    segment: str
    stop_threshold: float
    acceptance: _containers.RepeatedScalarFieldContainer[float]
    proposal: _containers.RepeatedScalarFieldContainer[float]
    prior_strength: float
    cost_ratio: float
    verify_cost: _containers.RepeatedScalarFieldContainer[float]
    probe_rounds: int
    calibration: float
    max_batch_size: int
    counterfactual_ks: _containers.ScalarMap[str, int]
    plain_rounds: int
    def __init__(self, drafter: _Optional[str] = ..., k: _Optional[int] = ..., reason: _Optional[str] = ..., policy_version: _Optional[str] = ..., exploration: _Optional[bool] = ..., expected_speedup: _Optional[float] = ..., stale: _Optional[bool] = ..., segment: _Optional[str] = ..., stop_threshold: _Optional[float] = ..., acceptance: _Optional[_Iterable[float]] = ..., proposal: _Optional[_Iterable[float]] = ..., prior_strength: _Optional[float] = ..., cost_ratio: _Optional[float] = ..., verify_cost: _Optional[_Iterable[float]] = ..., probe_rounds: _Optional[int] = ..., calibration: _Optional[float] = ..., max_batch_size: _Optional[int] = ..., counterfactual_ks: _Optional[_Mapping[str, int]] = ..., plain_rounds: _Optional[int] = ...) -> None: ...

class RoundsAggregate(_message.Message):
    __slots__ = ("segment", "drafter", "k", "rounds", "num_drafted", "num_accepted", "verified_per_position", "accepted_per_position", "tokens_emitted", "draft_seconds", "verify_seconds", "batch_size", "temperature", "prompt_tokens", "self_repetition", "proposed_per_position", "rounds_by_drafted", "verify_seconds_by_drafted", "counterfactual", "expected_speedup", "start_up_timings", "request_tokens_emitted", "request_seconds", "totals_only")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
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
    ROUNDS_BY_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    VERIFY_SECONDS_BY_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    COUNTERFACTUAL_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    START_UP_TIMINGS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TOKENS_EMITTED_FIELD_NUMBER: _ClassVar[int]
    REQUEST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTALS_ONLY_FIELD_NUMBER: _ClassVar[int]
    segment: str
    drafter: str
    k: int
    rounds: int
    num_drafted: int
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
    rounds_by_drafted: _containers.RepeatedScalarFieldContainer[int]
    verify_seconds_by_drafted: _containers.RepeatedScalarFieldContainer[float]
    counterfactual: bool
    expected_speedup: float
    start_up_timings: bool
    request_tokens_emitted: int
    request_seconds: float
    totals_only: bool
    def __init__(self, segment: _Optional[str] = ..., drafter: _Optional[str] = ..., k: _Optional[int] = ..., rounds: _Optional[int] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., verified_per_position: _Optional[_Iterable[int]] = ..., accepted_per_position: _Optional[_Iterable[int]] = ..., tokens_emitted: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., verify_seconds: _Optional[float] = ..., batch_size: _Optional[int] = ..., temperature: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., self_repetition: _Optional[float] = ..., proposed_per_position: _Optional[_Iterable[int]] = ..., rounds_by_drafted: _Optional[_Iterable[int]] = ..., verify_seconds_by_drafted: _Optional[_Iterable[float]] = ..., counterfactual: _Optional[bool] = ..., expected_speedup: _Optional[float] = ..., start_up_timings: _Optional[bool] = ..., request_tokens_emitted: _Optional[int] = ..., request_seconds: _Optional[float] = ..., totals_only: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("segment", "max_new_tokens", "prompt_tokens")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    segment: str
    max_new_tokens: int
    prompt_tokens: int
    def __init__(self, segment: _Optional[str] = ..., max_new_tokens: _Optional[int] = ..., prompt_tokens: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("drafter", "k", "rounds", "proposed", "accepted", "alpha", "alpha_ci_low", "alpha_ci_high", "mean_accepted_length", "expected_speedup")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    K_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    PROPOSED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    ALPHA_CI_LOW_FIELD_NUMBER: _ClassVar[int]
    ALPHA_CI_HIGH_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    k: int
    rounds: float
    proposed: float
    accepted: float
    alpha: float
    alpha_ci_low: float
    alpha_ci_high: float
    mean_accepted_length: float
    expected_speedup: float
    def __init__(self, drafter: _Optional[str] = ..., k: _Optional[int] = ..., rounds: _Optional[float] = ..., proposed: _Optional[float] = ..., accepted: _Optional[float] = ..., alpha: _Optional[float] = ..., alpha_ci_low: _Optional[float] = ..., alpha_ci_high: _Optional[float] = ..., mean_accepted_length: _Optional[float] = ..., expected_speedup: _Optional[float] = ...) -> None: ...

class DrafterStats(_message.Message):
    __slots__ = ("drafter", "positions", "cost_ratio", "by_k", "counterfactual_positions", "acceptance", "proposal", "calibration", "calibration_requests", "realised_speedup", "realised_requests", "best_k", "model_speedup", "expected_speedup", "lower_bound")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    COST_RATIO_FIELD_NUMBER: _ClassVar[int]
    BY_K_FIELD_NUMBER: _ClassVar[int]
    COUNTERFACTUAL_POSITIONS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_FIELD_NUMBER: _ClassVar[int]
    PROPOSAL_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_FIELD_NUMBER: _ClassVar[int]
    CALIBRATION_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    REALISED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    REALISED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    BEST_K_FIELD_NUMBER: _ClassVar[int]
    MODEL_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_SPEEDUP_FIELD_NUMBER: _ClassVar[int]
    LOWER_BOUND_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    positions: _containers.RepeatedCompositeFieldContainer[PositionStats]
    cost_ratio: float
    by_k: _containers.RepeatedCompositeFieldContainer[DrafterKStats]
    counterfactual_positions: _containers.RepeatedCompositeFieldContainer[PositionStats]
    acceptance: _containers.RepeatedScalarFieldContainer[float]
    proposal: _containers.RepeatedScalarFieldContainer[float]
    calibration: float
    calibration_requests: float
    realised_speedup: float
    realised_requests: float
    best_k: int
    model_speedup: float
    expected_speedup: float
    lower_bound: float
    def __init__(self, drafter: _Optional[str] = ..., positions: _Optional[_Iterable[_Union[PositionStats, _Mapping]]] = ..., cost_ratio: _Optional[float] = ..., by_k: _Optional[_Iterable[_Union[DrafterKStats, _Mapping]]] = ..., counterfactual_positions: _Optional[_Iterable[_Union[PositionStats, _Mapping]]] = ..., acceptance: _Optional[_Iterable[float]] = ..., proposal: _Optional[_Iterable[float]] = ..., calibration: _Optional[float] = ..., calibration_requests: _Optional[float] = ..., realised_speedup: _Optional[float] = ..., realised_requests: _Optional[float] = ..., best_k: _Optional[int] = ..., model_speedup: _Optional[float] = ..., expected_speedup: _Optional[float] = ..., lower_bound: _Optional[float] = ...) -> None: ...

class DriftAlarm(_message.Message):
    __slots__ = ("drafter", "direction", "since_unix", "raised_unix", "alpha_before", "alpha_since")
    DRAFTER_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    SINCE_UNIX_FIELD_NUMBER: _ClassVar[int]
    RAISED_UNIX_FIELD_NUMBER: _ClassVar[int]
    ALPHA_BEFORE_FIELD_NUMBER: _ClassVar[int]
    ALPHA_SINCE_FIELD_NUMBER: _ClassVar[int]
    drafter: str
    direction: str
    since_unix: float
    raised_unix: float
    alpha_before: float
    alpha_since: float
    def __init__(self, drafter: _Optional[str] = ..., direction: _Optional[str] = ..., since_unix: _Optional[float] = ..., raised_unix: _Optional[float] = ..., alpha_before: _Optional[float] = ..., alpha_since: _Optional[float] = ...) -> None: ...

class SegmentStats(_message.Message):
    __slots__ = ("segment", "drafters", "rounds", "last_update_unix", "decision", "stale", "drift")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    LAST_UPDATE_UNIX_FIELD_NUMBER: _ClassVar[int]
    DECISION_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    DRIFT_FIELD_NUMBER: _ClassVar[int]
    segment: str
    drafters: _containers.RepeatedCompositeFieldContainer[DrafterStats]
    rounds: float
    last_update_unix: float
    decision: Decision
    stale: bool
    drift: _containers.RepeatedCompositeFieldContainer[DriftAlarm]
    def __init__(self, segment: _Optional[str] = ..., drafters: _Optional[_Iterable[_Union[DrafterStats, _Mapping]]] = ..., rounds: _Optional[float] = ..., last_update_unix: _Optional[float] = ..., decision: _Optional[_Union[Decision, _Mapping]] = ..., stale: _Optional[bool] = ..., drift: _Optional[_Iterable[_Union[DriftAlarm, _Mapping]]] = ...) -> None: ...

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

class GetCostsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BucketCosts(_message.Message):
    __slots__ = ("batch_bucket", "step_seconds", "cost_ratio", "verify_cost", "verify_rounds", "measured", "spread", "mode")
    class CostRatioEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    BATCH_BUCKET_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COST_RATIO_FIELD_NUMBER: _ClassVar[int]
    VERIFY_COST_FIELD_NUMBER: _ClassVar[int]
    VERIFY_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    MEASURED_FIELD_NUMBER: _ClassVar[int]
    SPREAD_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    batch_bucket: int
    step_seconds: float
    cost_ratio: _containers.ScalarMap[str, float]
    verify_cost: _containers.RepeatedScalarFieldContainer[float]
    verify_rounds: _containers.RepeatedScalarFieldContainer[float]
    measured: bool
    spread: float
    mode: str
    def __init__(self, batch_bucket: _Optional[int] = ..., step_seconds: _Optional[float] = ..., cost_ratio: _Optional[_Mapping[str, float]] = ..., verify_cost: _Optional[_Iterable[float]] = ..., verify_rounds: _Optional[_Iterable[float]] = ..., measured: _Optional[bool] = ..., spread: _Optional[float] = ..., mode: _Optional[str] = ...) -> None: ...

class CostModel(_message.Message):
    __slots__ = ("buckets", "stale")
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedCompositeFieldContainer[BucketCosts]
    stale: bool
    def __init__(self, buckets: _Optional[_Iterable[_Union[BucketCosts, _Mapping]]] = ..., stale: _Optional[bool] = ...) -> None: ...

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

class WatchDecisionsRequest(_message.Message):
    __slots__ = ("worker_id", "drafters")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DRAFTERS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    drafters: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., drafters: _Optional[_Iterable[str]] = ...) -> None: ...

class TableProbe(_message.Message):
    __slots__ = ("plan", "probability")
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    plan: Decision
    probability: float
    def __init__(self, plan: _Optional[_Union[Decision, _Mapping]] = ..., probability: _Optional[float] = ...) -> None: ...

class BucketDecision(_message.Message):
    __slots__ = ("batch_bucket", "plan", "probes")
    BATCH_BUCKET_FIELD_NUMBER: _ClassVar[int]
    PLAN_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    batch_bucket: int
    plan: Decision
    probes: _containers.RepeatedCompositeFieldContainer[TableProbe]
    def __init__(self, batch_bucket: _Optional[int] = ..., plan: _Optional[_Union[Decision, _Mapping]] = ..., probes: _Optional[_Iterable[_Union[TableProbe, _Mapping]]] = ...) -> None: ...

class SegmentTable(_message.Message):
    __slots__ = ("segment", "max_batch_size", "min_new_tokens", "prefill_cost_per_token", "buckets", "above_max_batch_size")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COST_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    ABOVE_MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    segment: str
    max_batch_size: int
    min_new_tokens: int
    prefill_cost_per_token: float
    buckets: _containers.RepeatedCompositeFieldContainer[BucketDecision]
    above_max_batch_size: Decision
    def __init__(self, segment: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., min_new_tokens: _Optional[int] = ..., prefill_cost_per_token: _Optional[float] = ..., buckets: _Optional[_Iterable[_Union[BucketDecision, _Mapping]]] = ..., above_max_batch_size: _Optional[_Union[Decision, _Mapping]] = ...) -> None: ...

class DecisionTables(_message.Message):
    __slots__ = ("full", "segments", "removed", "policy_version", "stale", "refresh_seconds", "built_unix")
    FULL_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    POLICY_VERSION_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    REFRESH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BUILT_UNIX_FIELD_NUMBER: _ClassVar[int]
    full: bool
    segments: _containers.RepeatedCompositeFieldContainer[SegmentTable]
    removed: _containers.RepeatedScalarFieldContainer[str]
    policy_version: str
    stale: bool
    refresh_seconds: float
    built_unix: float
    def __init__(self, full: _Optional[bool] = ..., segments: _Optional[_Iterable[_Union[SegmentTable, _Mapping]]] = ..., removed: _Optional[_Iterable[str]] = ..., policy_version: _Optional[str] = ..., stale: _Optional[bool] = ..., refresh_seconds: _Optional[float] = ..., built_unix: _Optional[float] = ...) -> None: ...
