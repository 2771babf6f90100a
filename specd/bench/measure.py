"""What `specd bench` measures, and the figures it derives. Pure: samples in, ratios out.

Every ratio is decode tokens/s of an arm over ``none``'s on the same prompts in the same run: tokens over decode
seconds, pooled over the prompts (a segment's, or all). ``oracle`` is, per segment, the static arm (``none``
included) with the best ratio in hindsight; ``best_static`` is the one static arm with the best pooled ratio over
every segment.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

NONE, ADAPTIVE, ADAPTIVE_WARM = "none", "adaptive", "adaptive-warm"
DRAFT_KS = (1, 2, 3, 4, 6, 8)
LOOKUP_KS = (2, 4, 8, 12)
STATIC_ARMS = (NONE, *(f"draft:{k}" for k in DRAFT_KS), *(f"prompt_lookup:{k}" for k in LOOKUP_KS))
WARM_BASELINE = "none-warm"  # none again, beside the warm pass (the machine may have changed since the first)


def parse_arm(arm: str) -> tuple[str, int]:
    """A static arm's (drafter, K): "draft:4" -> ("draft", 4), "none" -> ("none", 0)."""
    if arm in (NONE, WARM_BASELINE):
        return "none", 0
    drafter, _, k = arm.partition(":")
    return drafter, int(k)


@dataclass(frozen=True)
class Sample:
    """One answered request of one arm."""

    arm: str
    segment: str
    prompt_id: str
    tokens: int
    decode_seconds: float
    greedy: bool
    text: str
    drafter: str = "none"  # what ran (the plan's drafter for the adaptive arms)
    k: int = 0  # the plan's K ceiling
    mean_k: float = 0.0  # the K its drafting rounds ran with, on average
    exploration: bool = False
    order: int = 0  # when it was answered, within its arm
    reason: str = ""  # the plan's reason
    expected_speedup: float = 1.0  # the controller's prediction for the plan it gave


@dataclass(frozen=True)
class Rate:
    tokens: int
    seconds: float

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def rate(samples: Iterable[Sample]) -> Rate:
    tokens = seconds = 0.0
    for s in samples:
        tokens += s.tokens
        seconds += s.decode_seconds
    return Rate(int(tokens), seconds)


def ratio(arm: Rate, none: Rate) -> float:
    return arm.per_second / none.per_second if none.per_second > 0 else 0.0


def by(samples: Sequence[Sample], arm: str, segment: str | None = None) -> list[Sample]:
    return [s for s in samples if s.arm == arm and (segment is None or s.segment == segment)]


def segments_of(samples: Sequence[Sample]) -> list[str]:
    """The segments the static arms ran on (the drift scenario's segment is reported apart)."""
    return list(dict.fromkeys(s.segment for s in samples if s.arm == NONE))


def outputs_equal(samples: Sequence[Sample]) -> tuple[bool, list[str]]:
    """Greedy outputs of every arm equal ``none``'s on the same prompt; the mismatches as "arm prompt_id"."""
    reference = {s.prompt_id: s.text for s in samples if s.arm == NONE and s.greedy}
    bad = [f"{s.arm} {s.prompt_id}" for s in samples if s.greedy and s.prompt_id in reference
           and s.text != reference[s.prompt_id]]  # fmt: skip
    return not bad, bad


def summarize(samples: Sequence[Sample]) -> dict[str, Any]:
    """bench.json's ``summary`` and ``segments`` (and the per-arm table behind them)."""
    segments = segments_of(samples)
    statics = [arm for arm in STATIC_ARMS if by(samples, arm)]
    none_all = rate(by(samples, NONE))
    per_segment: dict[str, dict[str, Any]] = {}
    oracle_samples: list[Sample] = []
    for segment in segments:
        none = rate(by(samples, NONE, segment))
        arms = {arm: ratio(rate(by(samples, arm, segment)), none) for arm in statics}
        oracle_arm = max(arms, key=lambda a: arms[a])
        oracle_samples += by(samples, oracle_arm, segment)
        warm_none = rate(by(samples, WARM_BASELINE, segment))
        per_segment[segment] = {
            "oracle_arm": oracle_arm,
            "oracle_vs_none": arms[oracle_arm],
            "adaptive_vs_none": ratio(rate(by(samples, ADAPTIVE, segment)), none),
            "adaptive_warm_vs_none": ratio(rate(by(samples, ADAPTIVE_WARM, segment)), warm_none),
            "none_tokens_per_second": none.per_second,
            "arms_vs_none": arms,
        }
    pooled = {arm: ratio(rate(by(samples, arm)), none_all) for arm in statics}
    best_static = max((a for a in pooled if a != NONE), key=lambda a: pooled[a], default=NONE)
    oracle = ratio(rate(oracle_samples), none_all)
    adaptive = ratio(rate(by(samples, ADAPTIVE)), none_all)
    warm = ratio(rate(by(samples, ADAPTIVE_WARM)), rate(by(samples, WARM_BASELINE)))
    equal, mismatches = outputs_equal(samples)
    summary = {
        "adaptive_vs_none": adaptive,
        "adaptive_warm_vs_none": warm,
        "best_static": best_static,
        "best_static_vs_none": pooled.get(best_static, 1.0),
        "oracle_vs_none": oracle,
        "adaptive_vs_oracle": adaptive / oracle if oracle else 0.0,
        "adaptive_warm_vs_oracle": warm / oracle if oracle else 0.0,
        "adaptive_warm_vs_best_static": warm / pooled[best_static] if pooled.get(best_static) else 0.0,
        "outputs_equal": equal,
    }
    return {"summary": summary, "segments": per_segment, "arms_vs_none": pooled, "mismatches": mismatches}
