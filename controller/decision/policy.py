"""YAML policies: defaults plus per-segment rules, validated before they apply, versioned by content hash.

A rule matches a segment by exact name or glob; an exact name beats any glob, and among globs the first
listed wins. A rule's settings override the defaults field by field.
"""

from __future__ import annotations

import fnmatch
import hashlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

from pydantic import ConfigDict, Field, field_validator, model_validator

from controller.decision.rule_globs import dead_rules
from specd_api.checks import MAX_BATCH_SIZE, MAX_INT32
from specd_api.config_base import Strict
from specd_api.lru import LruMemory
from specd_api.modes import base_segment
from specd_api.yaml_config import (
    DEFAULT_LIMITS,
    ConfigError,
    YamlLimits,
    load_yaml_model,
    parse_yaml_model,
    read_regular_file,
    read_stable_text,
)

MAX_RULES = 1_000  # segment rules in one policy file
RESOLVED_SEGMENTS = 10_000  # segments whose settings a policy remembers (the controller's segment cap is 1,000)

DrafterName = Literal["draft", "prompt_lookup", "chain", "suffix", "eagle"]
# specd_api.plan.DRAFTERS, typed for pydantic
DRAFTERS: tuple[DrafterName, ...] = ("draft", "prompt_lookup", "chain", "suffix", "eagle")


def drafter_set(drafters: Sequence[str]) -> tuple[str, ...]:
    """The drafters a worker offers, as one set: sorted, each once, "none" aside (the tables' key, and the hysteresis
    memory's, whatever order a worker lists them in)."""
    return tuple(sorted({d for d in drafters if d != "none"}))


class PolicyModel(Strict):
    """A part of the policy file: strict, and every number in it finite. An infinite value would be accepted by the
    bounds below (``ge=``, ``gt=``) and then break decisions: ``prior_strength: .inf`` makes Thompson sampling's
    ``random.betavariate`` loop forever, hanging every Decide."""

    model_config = ConfigDict(allow_inf_nan=False)


class DrafterSettings(PolicyModel):
    enabled: bool = True
    k_min: int = Field(1, ge=1, le=64)
    k_max: int = Field(8, ge=1, le=64)
    prior_alpha: float = Field(0.5, gt=0.0, lt=1.0, description="acceptance assumed before any data")
    cost_ratio: float = Field(0.1, ge=0.0, description="c assumed before the workers' timings arrive")
    stop_threshold: float = Field(
        0.0, ge=0.0, lt=1.0, description="the draft model ends a round when its confidence is lower (0: never)"
    )

    @model_validator(mode="after")
    def _k_bounds(self) -> DrafterSettings:
        if self.k_min > self.k_max:
            raise ValueError(f"k_min ({self.k_min}) must not exceed k_max ({self.k_max})")
        return self


class DrafterOverride(PolicyModel):
    enabled: bool | None = None
    k_min: int | None = Field(None, ge=1, le=64)
    k_max: int | None = Field(None, ge=1, le=64)
    prior_alpha: float | None = Field(None, gt=0.0, lt=1.0)
    cost_ratio: float | None = Field(None, ge=0.0)
    stop_threshold: float | None = Field(None, ge=0.0, lt=1.0)


def _default_drafters() -> dict[DrafterName, DrafterSettings]:
    return {
        "draft": DrafterSettings(k_min=1, k_max=8, prior_alpha=0.6, cost_ratio=0.1),
        "prompt_lookup": DrafterSettings(k_min=1, k_max=10, prior_alpha=0.3, cost_ratio=0.0),
        # lookup's one-hot rounds when it finds a match (c ≈ 0), else the draft model's: c between the two
        "chain": DrafterSettings(k_min=1, k_max=8, prior_alpha=0.5, cost_ratio=0.05),
        # model-free like lookup (c ≈ 0); its proposals stop where the matched continuation's frequency falls
        "suffix": DrafterSettings(k_min=1, k_max=16, prior_alpha=0.3, cost_ratio=0.0),
        # a draft head on the target's states: one layer of the target's width, no prefill of its own
        "eagle": DrafterSettings(k_min=1, k_max=8, prior_alpha=0.6, cost_ratio=0.15),
    }


class Settings(PolicyModel):
    """Everything a decision depends on, for one segment."""

    max_batch_size: int = Field(
        8, ge=0, le=MAX_BATCH_SIZE, description="speculation is off above this batch size"
    )  # bounded: a value past int32 broke every WatchDecisions (the decision table's field)
    min_speedup: float = Field(1.05, ge=1.0, description="switch off when the best expected speedup is lower")
    exploration_rate: float = Field(
        0.25, ge=0.0, le=0.5, description="at most this share of requests probe (Thompson sampling picks which)"
    )
    min_exploration_rate: float = Field(
        0.02, ge=0.0, le=0.5, description="a switched-off segment probes at least this share of its requests"
    )
    hysteresis: float = Field(0.05, ge=0.0, le=1.0, description="relative margin a change must win by")
    min_new_tokens: int = Field(
        4, ge=1, le=MAX_INT32, description="shorter requests are never speculated"
    )  # bounded: 2**31 passed the check, then every WatchDecisions failed (the decision table's int32 field)
    prefill_cost_per_token: float = Field(
        0.02, ge=0.0, description="draft-model prefill cost per prompt token, in target steps × c"
    )
    prior_strength: float = Field(20.0, gt=0.0, description="pseudo-counts of the prior per position")
    plan_prior_rounds: float = Field(
        8.0, ge=0.0, description="pseudo-rounds the controller's estimate weighs against a request's own rounds"
    )
    probe_rounds: int = Field(4, ge=0, le=64, description="rounds a probe runs at k_max before adapting")
    k_headroom: int = Field(2, ge=0, le=64, description="a plan's K ceiling: the best K plus this much room")
    counterfactual: bool = Field(
        True, description="score prompt lookup (every request) and suffix decoding (a share) whatever drafter runs"
    )
    force: Literal["draft", "prompt_lookup", "chain", "suffix", "eagle", "none"] | None = None
    force_k: int | None = Field(None, ge=1, le=64, description="K when force names a drafter")
    drafters: dict[DrafterName, DrafterSettings] = Field(default_factory=_default_drafters)

    @field_validator("drafters", mode="before")
    @classmethod
    def _over_builtin_drafters(cls, value: object) -> object:
        """A file names only what it changes: its drafter fields go over the built-in ones, field by field."""
        if not isinstance(value, dict):
            return value  # let validation report the wrong type
        merged: dict[str, object] = {name: s.model_dump() for name, s in _default_drafters().items()}
        for name, given in value.items():
            base = merged.get(name)
            merged[name] = {**base, **given} if isinstance(base, dict) and isinstance(given, dict) else given
        return merged

    def drafter(self, name: str) -> DrafterSettings:
        """Settings of drafter ``name``; KeyError for a name the policy does not know."""
        return self.drafters[cast(DrafterName, name)]


class SettingsOverride(PolicyModel):
    max_batch_size: int | None = Field(None, ge=0, le=MAX_BATCH_SIZE)
    min_speedup: float | None = Field(None, ge=1.0)
    exploration_rate: float | None = Field(None, ge=0.0, le=0.5)
    min_exploration_rate: float | None = Field(None, ge=0.0, le=0.5)
    hysteresis: float | None = Field(None, ge=0.0, le=1.0)
    min_new_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    prefill_cost_per_token: float | None = Field(None, ge=0.0)
    prior_strength: float | None = Field(None, gt=0.0)
    plan_prior_rounds: float | None = Field(None, ge=0.0)
    probe_rounds: int | None = Field(None, ge=0, le=64)
    k_headroom: int | None = Field(None, ge=0, le=64)
    counterfactual: bool | None = None
    force: Literal["draft", "prompt_lookup", "chain", "suffix", "eagle", "none"] | None = None
    force_k: int | None = Field(None, ge=1, le=64)
    drafters: dict[DrafterName, DrafterOverride] = Field(default_factory=dict)


class SegmentRule(SettingsOverride):
    match: str = Field(min_length=1, description="a segment name, or a glob such as 'tenant-*'")


class PolicyDocument(PolicyModel):
    """The YAML file's shape."""

    defaults: Settings = Field(default_factory=lambda: Settings())
    segments: list[SegmentRule] = Field(
        default_factory=list, max_length=MAX_RULES,
        description=f"at most {MAX_RULES} rules (a glob is tried per new segment; 25,000 cost 22 ms per Decide)",
    )  # fmt: skip

    @model_validator(mode="after")
    def _rules_resolve(self) -> PolicyDocument:
        for i, rule in enumerate(self.segments):
            try:
                apply_override(self.defaults, rule)
            except ValueError as e:
                raise ValueError(f"segments[{i}] (match {rule.match!r}): {e}") from None
        return self

    @field_validator("segments")
    @classmethod
    def _no_dead_rules(cls, rules: list[SegmentRule]) -> list[SegmentRule]:
        """A rule that can never apply is refused (``rule_globs``): it is a rule its writer expects to hold."""
        dead = dead_rules([rule.match for rule in rules])
        if dead:
            i, why = next(iter(dead.items()))
            more = f" ({len(dead) - 1} more such rules)" if len(dead) > 1 else ""
            raise ValueError(f"segments[{i}] (match {rules[i].match!r}) can never apply: {why}{more}")
        return rules


def apply_override(base: Settings, override: SettingsOverride) -> Settings:
    """``base`` with every field the override sets replaced (drafters merged field by field)."""
    changes = {
        name: getattr(override, name)
        for name in SettingsOverride.model_fields
        if name != "drafters" and getattr(override, name) is not None
    }
    drafters = dict(base.drafters)
    for name, drafter_override in override.drafters.items():
        merged = base.drafters[name].model_dump() | drafter_override.model_dump(exclude_none=True)
        drafters[name] = DrafterSettings.model_validate(merged)  # re-checks k_min <= k_max after merging
    return base.model_copy(update={**changes, "drafters": drafters})


@dataclass(frozen=True)
class Policy:
    """A validated policy in force."""

    document: PolicyDocument
    version: str  # content hash of the file
    path: str
    text: str
    loaded_unix: float
    _resolved: LruMemory[Settings] = field(default_factory=lambda: LruMemory(RESOLVED_SEGMENTS), compare=False,
                                           repr=False)  # fmt: skip

    def for_segment(self, segment: str) -> Settings:
        """The settings of ``segment`` (a learning segment's are its base segment's: specd_api.modes): resolved once
        per segment (rules are matched in order, a glob each), then remembered for this policy's life (bounded), so a
        Decide costs no rule matching."""
        segment = base_segment(segment)
        known = self._resolved.recall(segment)
        if known is not None:
            return known
        rules = self.document.segments
        exact = next((r for r in rules if r.match == segment), None)
        rule = exact or next((r for r in rules if fnmatch.fnmatchcase(segment, r.match)), None)
        settings = apply_override(self.document.defaults, rule) if rule else self.document.defaults
        self._resolved.remember(segment, settings)
        return settings


def content_version(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file; raises ConfigError (file, line, field, reason) when invalid."""
    document, text = load_yaml_model(path, PolicyDocument)
    return Policy(document, content_version(text), str(path), text, time.time())


def parse_policy(text: str, source: str = "<policy>") -> Policy:
    document = parse_yaml_model(text, PolicyDocument, source)
    return Policy(document, content_version(text), source, text, time.time())


class PolicyStore:
    """The policy in force; reloads swap it atomically, and a bad file leaves it in place.

    A reload reads the file until its content is stable (an editor's save in progress is not taken half-written),
    and a content that was refused is remembered by its hash: the watcher does not try it again (nor log it again)
    until the file changes.
    """

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._lock = threading.Lock()
        self._refused: str | None = None  # version of the file content last refused

    @property
    def current(self) -> Policy:
        return self._policy  # a single reference read: atomic under the GIL

    def reload(self, settle_seconds: float = 0.25) -> Policy:
        """Load the file again. Raises ConfigError and keeps the old policy when the file is invalid."""
        with self._lock:
            path = self._policy.path
            try:
                text = read_stable_text(path, settle_seconds=settle_seconds)
                policy = parse_policy(text, source=path)
            except ConfigError:
                self._refused = file_version(path)
                raise
            self._policy, self._refused = policy, None
            return policy

    def file_changed(self) -> bool:
        """True when the file on disk differs from the policy in force and from the content last refused (for the
        reload watcher)."""
        version = file_version(self._policy.path)
        return version is not None and version not in (self._policy.version, self._refused)


def file_version(path: str | Path, limits: YamlLimits = DEFAULT_LIMITS) -> str | None:
    """The content version of a file's bytes (equal to ``content_version`` of its text when it is UTF-8), or None
    when it cannot be read; at most the loader's size limit (plus one byte) is read."""
    try:
        data = read_regular_file(path, limits.max_bytes + 1)
    except OSError:
        return None
    return hashlib.sha256(data).hexdigest()[:12]
