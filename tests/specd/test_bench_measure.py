"""specd bench's figures from samples (specd.bench.measure), on numbers that can be checked by hand."""

from __future__ import annotations

import pytest

from specd.bench.measure import ADAPTIVE, ADAPTIVE_WARM, NONE, WARM_BASELINE, Sample, outputs_equal, summarize


def sample(arm: str, segment: str, seconds: float, prompt: str = "p", tokens: int = 100, text: str = "x",
           greedy: bool = True) -> Sample:  # fmt: skip
    return Sample(arm, segment, f"{segment}-{prompt}", tokens, seconds, greedy, text)


def run(table: dict[str, dict[str, float]]) -> list[Sample]:
    """``table[segment][arm]`` = decode seconds of 100 tokens on that segment's one prompt."""
    return [sample(arm, segment, seconds) for segment, arms in table.items() for arm, seconds in arms.items()]


# code: draft:4 doubles the speed; chat: prompt lookup gains 25%; noise: nothing beats none
TABLE = {
    "code": {NONE: 1.0, "draft:4": 0.5, "prompt_lookup:8": 0.9, ADAPTIVE: 0.55, WARM_BASELINE: 1.0, ADAPTIVE_WARM: 0.5},
    "chat": {NONE: 1.0, "draft:4": 1.1, "prompt_lookup:8": 0.8, ADAPTIVE: 0.9, WARM_BASELINE: 1.0, ADAPTIVE_WARM: 0.8},
    "noise": {NONE: 1.0, "draft:4": 1.5, "prompt_lookup:8": 1.2, ADAPTIVE: 1.02, WARM_BASELINE: 1.0,
              ADAPTIVE_WARM: 1.0},
}  # fmt: skip


def test_oracle_best_static_and_ratios():
    d = summarize(run(TABLE))
    segments, s = d["segments"], d["summary"]
    # per segment, the best static arm in hindsight; none itself where nothing beats it
    assert {k: v["oracle_arm"] for k, v in segments.items()} == {"code": "draft:4", "chat": "prompt_lookup:8",
                                                                 "noise": NONE}  # fmt: skip
    assert segments["code"]["oracle_vs_none"] == pytest.approx(2.0)
    assert segments["chat"]["adaptive_vs_none"] == pytest.approx(1 / 0.9)
    # pooled over the segments: 300 tokens in 3.0 s for none; the oracle takes 0.5 + 0.8 + 1.0 s
    assert s["oracle_vs_none"] == pytest.approx(3.0 / 2.3)
    # draft:4 pooled: 3.0 / (0.5 + 1.1 + 1.5) = 0.97; prompt lookup: 3.0 / 2.9 = 1.03: the best single static arm
    assert (s["best_static"], s["best_static_vs_none"]) == ("prompt_lookup:8", pytest.approx(3.0 / 2.9))
    assert s["adaptive_vs_none"] == pytest.approx(3.0 / (0.55 + 0.9 + 1.02))
    assert s["adaptive_warm_vs_none"] == pytest.approx(3.0 / 2.3)
    assert s["adaptive_warm_vs_oracle"] == pytest.approx(1.0)
    assert s["adaptive_vs_oracle"] == pytest.approx(s["adaptive_vs_none"] / s["oracle_vs_none"])
    assert s["adaptive_warm_vs_best_static"] == pytest.approx((3.0 / 2.3) / (3.0 / 2.9))
    assert s["outputs_equal"] is True


def test_the_warm_pass_is_judged_against_none_measured_beside_it():
    # the machine slowed down between the passes: none-warm is 2x slower, and so is adaptive-warm
    table = {"code": {NONE: 1.0, "draft:4": 0.5, ADAPTIVE: 0.5, WARM_BASELINE: 2.0, ADAPTIVE_WARM: 1.0}}
    assert summarize(run(table))["summary"]["adaptive_warm_vs_none"] == pytest.approx(2.0)


def test_greedy_outputs_must_equal_none_and_sampled_ones_need_not():
    samples = [
        sample(NONE, "code", 1.0, text="abc"),
        sample("draft:4", "code", 0.5, text="abc"),
        sample("prompt_lookup:8", "code", 0.5, text="abd"),  # a greedy output that differs: a bug
        sample(NONE, "chat", 1.0, text="hello", greedy=False),
        sample("draft:4", "chat", 0.5, text="world", greedy=False),  # sampled: another draw, fine
    ]
    assert outputs_equal(samples) == (False, ["prompt_lookup:8 code-p"])
    assert summarize(samples)["summary"]["outputs_equal"] is False
    assert outputs_equal(samples[:2] + samples[3:]) == (True, [])


def test_the_drift_switch_point():
    from specd.bench.run import switch_point

    def t(phase: str, drafter: str, exploration: bool = False) -> dict:
        return {"phase": phase, "drafter": drafter, "exploration": exploration, "seconds_since_switch": 1.0}

    high = [t("high", "draft")] * 8
    # two more drafts after the switch, then prompt lookup and none (a draft probe does not count)
    low = [t("low", "draft"), t("low", "draft"), t("low", "prompt_lookup"), t("low", "draft", True), t("low", "none")]
    assert switch_point(high + low) == {"before": "draft", "requests_to_switch": 2, "seconds_to_switch": 1.0}
    never = high + [t("low", "draft")] * 3
    assert switch_point(never)["requests_to_switch"] is None
