"""specd bench's figures from samples (specd.bench.measure), on numbers that can be checked by hand."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

import pytest

from specd.bench.measure import (
    ADAPTIVE,
    ADAPTIVE_WARM,
    NONE,
    WARM_BASELINE,
    PromptRatio,
    Sample,
    bootstrap,
    first_at_final_plan,
    geomean_ratio,
    median_ratio,
    outputs_equal,
    repeats,
    static_arms,
    summarize,
)


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
    # over the segments, medians of per-prompt ratios: the oracle's are 2.0 (code), 1.25 (chat), 1.0 (noise)
    assert s["oracle_vs_none"] == pytest.approx(1.25)
    # draft:4 per prompt 2.0, 0.91, 0.67 (median 0.91); prompt lookup 1.11, 1.25, 0.83 (1.11): the best static arm
    assert (s["best_static"], s["best_static_vs_none"]) == ("prompt_lookup:8", pytest.approx(1 / 0.9))
    assert s["adaptive_vs_none"] == pytest.approx(1 / 0.9)  # 1.82, 1.11, 0.98
    assert s["adaptive_warm_vs_none"] == pytest.approx(1.25)  # 2.0, 1.25, 1.0
    assert s["adaptive_warm_vs_oracle"] == pytest.approx(1.0)  # the oracle on every prompt
    assert s["adaptive_vs_oracle"] == pytest.approx(1 / 0.55 / 2)  # 0.91, 0.89, 0.98: per prompt, then the median
    assert s["adaptive_warm_vs_best_static"] == pytest.approx(1.2)  # 2.0 / 1.11 = 1.8, 1.0, 1.0 / 0.83 = 1.2
    assert s["outputs_equal"] is True
    # the pooled totals, kept for the record: 300 tokens in 3.0 s for none; the oracle takes 0.5 + 0.8 + 1.0 s
    t = d["totals"]["summary"]
    assert t["oracle_vs_none"] == pytest.approx(3.0 / 2.3)
    assert (t["best_static"], t["best_static_vs_none"]) == ("prompt_lookup:8", pytest.approx(3.0 / 2.9))
    assert t["adaptive_vs_none"] == pytest.approx(3.0 / (0.55 + 0.9 + 1.02))
    assert t["adaptive_warm_vs_best_static"] == pytest.approx((3.0 / 2.3) / (3.0 / 2.9))


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


def prompts(segment: str, arms: dict[str, list[float]]) -> list[Sample]:
    """``arms[arm][i]`` = decode seconds of 100 tokens on the segment's prompt i."""
    return [sample(arm, segment, seconds, prompt=str(i)) for arm, row in arms.items() for i, seconds in enumerate(row)]


def test_a_stalled_none_request_moves_the_paired_median_by_one_rank_not_the_figure():
    # 12 prompts; draft:4 and adaptive take half of none's time on each, and one none request stalled 50x
    none = [1.0] * 12
    none[5] = 50.0
    half = [0.5] * 12
    samples = prompts("code", {NONE: none, "draft:4": half, ADAPTIVE: half, WARM_BASELINE: [1.0] * 12,
                               ADAPTIVE_WARM: half})  # fmt: skip
    d = summarize(samples)
    code = d["segments"]["code"]
    # per prompt the ratio is 2.0 on eleven prompts and 100 on the stalled one: the median is 2.0
    assert code["arms_vs_none"]["draft:4"] == pytest.approx(2.0, rel=0.03)
    assert code["adaptive_vs_none"] == pytest.approx(2.0, rel=0.03)
    assert code["oracle_vs_none"] == pytest.approx(2.0, rel=0.03)
    assert d["summary"]["adaptive_vs_none"] == pytest.approx(2.0, rel=0.03)
    assert d["summary"]["adaptive_vs_oracle"] == pytest.approx(1.0, rel=0.03)
    assert code["adaptive_vs_none_interval"][1] < 3.0  # the stall cannot stretch the interval to 100
    # pooled, the one stall dominates: none's 61 s against 6 s reads as a 10x speedup
    assert d["totals"]["segments"]["code"]["adaptive_vs_none"] == pytest.approx(61.0 / 6.0)


def test_a_stalled_adaptive_request_costs_one_rank_too():
    slow = [0.5] * 12
    slow[3] = 25.0  # the adaptive arm's own request stalled 50x
    d = summarize(prompts("code", {NONE: [1.0] * 12, ADAPTIVE: slow}))
    assert d["segments"]["code"]["adaptive_vs_none"] == pytest.approx(2.0, rel=0.03)
    assert d["totals"]["segments"]["code"]["adaptive_vs_none"] == pytest.approx(12.0 / 30.5)


def ratios(values: list[float]) -> list[PromptRatio]:
    return [PromptRatio((0, "s", str(i)), v, 100) for i, v in enumerate(values)]


def test_the_bootstrap_interval_holds_the_median_and_is_the_same_for_the_same_seed():
    rs = ratios([0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 2.0, 0.7])
    median = median_ratio(rs)
    assert median == pytest.approx(1.05)
    low, high = bootstrap(rs, median_ratio, seed=7)
    assert low < median < high  # 11 distinct values: resampled medians spread both sides
    assert (low, high) == bootstrap(rs, median_ratio, seed=7)  # seeded: deterministic
    assert bootstrap(rs, median_ratio, seed=8) != (0.0, 0.0)
    assert low >= 0.7 and high <= 2.0  # a median of resamples is one of the values
    g_low, g_high = bootstrap(rs, geomean_ratio, seed=7)
    assert g_low < geomean_ratio(rs) < g_high
    # a mean of resamples takes many values, so only the seed makes the interval repeat, and another seed moves it
    assert (g_low, g_high) == bootstrap(rs, geomean_ratio, seed=7)
    assert (g_low, g_high) != bootstrap(rs, geomean_ratio, seed=8)
    # a constant set has a point interval; no prompts, (0, 0)
    assert bootstrap(ratios([1.3] * 5), median_ratio) == (pytest.approx(1.3), pytest.approx(1.3))
    assert bootstrap([], median_ratio) == (0.0, 0.0)


def test_the_intervals_in_the_summary_come_from_the_same_seed():
    samples = prompts("code", {NONE: [1.0] * 8, ADAPTIVE: [0.4, 0.5, 0.6, 0.7, 0.5, 0.45, 0.55, 0.8]})
    first, again = summarize(samples, seed=3), summarize(samples, seed=3)
    assert first["intervals"] == again["intervals"]
    low, high = first["intervals"]["adaptive_vs_none"]
    assert low <= first["summary"]["adaptive_vs_none"] <= high


def test_the_oracle_is_the_arm_with_the_best_paired_median_per_segment():
    # code: draft:4 is 1.5x on two prompts of three and 0.2x on the third (long, slow): its median is 1.5 where its
    # pooled total (0.47) and its geometric mean (0.77) lose to prompt lookup's steady 1.2x.
    # chat: prompt lookup 1.25x on every prompt; draft:4 0.5x.
    code = prompts("code", {NONE: [1.0, 1.0, 1.0], "draft:4": [1 / 1.5, 1 / 1.5, 5.0],
                            "prompt_lookup:8": [1 / 1.2] * 3})  # fmt: skip
    chat = prompts("chat", {NONE: [1.0, 1.0, 1.0], "draft:4": [2.0] * 3, "prompt_lookup:8": [0.8] * 3})
    d = summarize(code + chat)
    assert d["segments"]["code"]["oracle_arm"] == "draft:4"
    assert d["segments"]["code"]["oracle_vs_none"] == pytest.approx(1.5)
    assert d["segments"]["chat"]["oracle_arm"] == "prompt_lookup:8"
    assert d["totals"]["segments"]["code"]["oracle_arm"] == "prompt_lookup:8"  # what the pooled figure picked
    # over all prompts: each prompt under its segment's oracle arm (1.5, 1.5, 0.2, 1.25, 1.25, 1.25): median 1.25
    assert d["summary"]["oracle_vs_none"] == pytest.approx(1.25)
    # the one best static arm over all prompts: prompt lookup (1.2, 1.2, 1.2, 1.25 x3: 1.225) beats draft:4 (0.5)
    assert d["summary"]["best_static"] == "prompt_lookup:8"


def test_calibration_is_realised_over_expected_for_requests_that_speculated():
    samples = [
        *prompts("code", {NONE: [1.0] * 3}),
        Sample(ADAPTIVE, "code", "code-0", 100, 0.5, True, "x", drafter="draft", k=4, expected_speedup=2.5),  # 2/2.5
        Sample(ADAPTIVE, "code", "code-1", 100, 0.5, True, "x", drafter="draft", k=4, expected_speedup=2.0),  # 2/2
        Sample(ADAPTIVE, "code", "code-2", 100, 1.0, True, "x", drafter="none", expected_speedup=1.0),  # no draft
    ]
    cal = summarize(samples)["calibration"]["code"]
    assert cal["cold"] == pytest.approx(0.9) and cal["cold_requests"] == 2
    assert cal["warm"] is None and cal["warm_requests"] == 0


def test_decisions_count_drafters_probes_and_the_first_request_at_the_final_plan():
    def adaptive(order: int, drafter: str, k: int, probe: bool = False) -> Sample:
        return Sample(ADAPTIVE, "code", f"code-{order}", 100, 0.5, True, "x", drafter=drafter, k=k, order=order,
                      exploration=probe)  # fmt: skip

    plans = [adaptive(0, "none", 0), adaptive(3, "draft", 2), adaptive(6, "draft", 4), adaptive(9, "prompt_lookup", 8,
             probe=True), adaptive(12, "draft", 4), adaptive(15, "draft", 4)]  # fmt: skip
    samples = [*prompts("code", {NONE: [1.0] * 16}), *plans]
    cold = summarize(samples)["decisions"]["code"]["cold"]
    assert cold["drafters"] == {"none": 1, "draft": 4, "prompt_lookup": 1} and cold["probes"] == 1
    # draft:4 from order 6 on, the probe at 9 aside
    assert (cold["final_plan"], cold["first_at_final_plan"]) == (["draft:4"], [6])
    assert first_at_final_plan([adaptive(0, "draft", 4, probe=True)]) == (None, None)


def test_repeats_give_each_runs_headline_and_their_spread():
    one = [replace(s, run=0) for s in prompts("code", {NONE: [1.0] * 4, ADAPTIVE: [0.5] * 4})]
    two = [replace(s, run=1) for s in prompts("code", {NONE: [1.0] * 4, ADAPTIVE: [0.25] * 4})]
    d = summarize(one + two)
    r = repeats(one + two, d["summary"])
    assert [run["adaptive_vs_none"] for run in r["runs"]] == [pytest.approx(2.0), pytest.approx(4.0)]
    spread = r["spread"]["adaptive_vs_none"]
    assert (spread["min"], spread["max"]) == (pytest.approx(2.0), pytest.approx(4.0))
    assert spread["max_relative_deviation"] == pytest.approx(1 / 3)  # mean 3.0, each 1.0 away
    # prompts are paired within their run: none of run 0 never meets adaptive of run 1
    assert d["summary"]["adaptive_vs_none"] == pytest.approx(3.0)  # the median of 2, 2, 2, 2, 4, 4, 4, 4


def test_static_arms_follow_what_the_worker_offers():
    assert not any(a.startswith("chain") for a in static_arms(("draft", "prompt_lookup")))
    assert {"chain:2", "chain:4"} <= set(static_arms(("draft", "prompt_lookup", "chain")))
    assert not any(a.startswith("suffix") for a in static_arms(("draft", "prompt_lookup")))
    assert {"suffix:4", "suffix:8"} <= set(static_arms(("prompt_lookup", "suffix")))
    assert not any(a.startswith("eagle") for a in static_arms(("draft", "prompt_lookup", "chain", "suffix")))
    assert {"eagle:2", "eagle:4", "eagle:6"} <= set(static_arms(("eagle",)))
    assert static_arms(()) == (NONE,)


def test_measured_requests_share_no_output_and_the_primers_are_held_out_prompts(tmp_path):
    """Every arm decodes the same prompts, so a measured request must not feed the suffix cache (it would propose a
    prompt's own output to the arms after it); the cache is primed with prompts the bench does not measure."""
    from specd.bench.run import body, held_out, load_prompts
    from workloads import Prompt

    lines = [Prompt(f"s-{i:03d}", "s", f"prompt {i} " * 20, 32, 0.0) for i in range(10)]
    path = tmp_path / "s.jsonl"
    path.write_text("".join(json.dumps(dataclasses.asdict(p)) + "\n" for p in lines))
    chosen = load_prompts([path], 4, seed=0)
    primers = held_out([path], chosen, 3)
    assert len(primers) == 3 and not {p.id for p in primers} & {p.id for p in chosen["s"]}
    assert all(body(p, arm, 32)["share_outputs"] is False for p in chosen["s"] for arm in ("none", "suffix:4"))
