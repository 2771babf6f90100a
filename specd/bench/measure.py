"""What `specd bench` measures, and the figures it derives. Pure: samples in, figures out.

Every figure is paired. Per prompt, an arm's decode rate (tokens / decode seconds of that one request) over
``none``'s on the same prompt in the same rotation (pass 1: the ``none`` sample; the warm pass: ``none-warm``,
measured beside it). A segment's figure, or the run's, is the **median** of those per-prompt ratios, with a
tokens-weighted geometric mean beside it where a mean is wanted; each has a seeded bootstrap 95 % interval
(resampling prompts). A stall is then one prompt's ratio out of many: it moves a median by one rank, where it
dominated a figure pooled over the prompts (total tokens / total decode seconds; kept as ``totals``, for the record).

``oracle`` is, per segment, the static arm (``none`` included) with the best paired median; over all segments it is
each prompt's ratio under its segment's oracle arm, median over every prompt. ``best_static`` is the one static arm
(``none`` aside) with the best paired median over every prompt. A figure of one arm over another (adaptive over the
oracle) is the median over prompts of the per-prompt quotient of their ratios.

Both are chosen in hindsight, the best of about fifteen noisy arms on the very prompts they are scored on, which
flatters them. The cross-fitted figures (``*_cross``) choose on one half of each segment's prompts and score on the
other (``halves``: each prompt in the same half in every run), then the other way round: what a fixed setting chosen
on past traffic would have given.

The A/A (specd.bench.aa): the controlled worker, every decision ``none``, over the uncontrolled one
(``controlled_none_vs_uncontrolled``). Time to first token (``ttft_adaptive_vs_none``): the paired median of the
adaptive arm's over ``none``'s, both passes (lower is better).
"""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

NONE, ADAPTIVE, ADAPTIVE_WARM = "none", "adaptive", "adaptive-warm"
DRAFT_KS = (1, 2, 3, 4, 6, 8)
LOOKUP_KS = (2, 4, 8, 12)
CHAIN_KS = (2, 4)  # run only where the worker offers the chain (``static_arms``)
SUFFIX_KS = (4, 8)
EAGLE_KS = (2, 4, 6)  # run only where the worker offers a head (``static_arms``; ``specd bench --head``)
STATIC_ARMS = (
    NONE,
    *(f"draft:{k}" for k in DRAFT_KS),
    *(f"prompt_lookup:{k}" for k in LOOKUP_KS),
    *(f"chain:{k}" for k in CHAIN_KS),
    *(f"suffix:{k}" for k in SUFFIX_KS),
    *(f"eagle:{k}" for k in EAGLE_KS),
)
WARM_BASELINE = "none-warm"  # none again, beside the warm pass (the machine may have changed since the first)
# The A/A pass: the controlled worker with every decision none (its aa/* segments), beside the uncontrolled one's none
AA_CONTROLLED, AA_UNCONTROLLED = "aa-controlled", "aa-uncontrolled"
RESAMPLES = 1000  # bootstrap resamples per interval
SEED = 0  # the bootstrap's: the same samples give the same intervals
LEVEL = 0.95
# The headline ratios (bench.json ``summary``, ``intervals``, ``geomeans``, the spread over repeats).
HEADLINE = ("adaptive_vs_none", "adaptive_warm_vs_none", "best_static_vs_none", "oracle_vs_none", "adaptive_vs_oracle",
            "adaptive_warm_vs_oracle", "adaptive_warm_vs_best_static", "adaptive_vs_oracle_cross",
            "adaptive_warm_vs_oracle_cross", "adaptive_warm_vs_best_static_cross", "controlled_none_vs_uncontrolled",
            "ttft_adaptive_vs_none")  # fmt: skip


def parse_arm(arm: str) -> tuple[str, int]:
    """A static arm's (drafter, K): "draft:4" -> ("draft", 4), "none" -> ("none", 0)."""
    if arm in (NONE, WARM_BASELINE, AA_UNCONTROLLED):
        return "none", 0
    drafter, _, k = arm.partition(":")
    return drafter, int(k)


def static_arms(offered: Collection[str]) -> tuple[str, ...]:
    """The static arms whose drafter the worker offers (``none`` always)."""
    return tuple(arm for arm in STATIC_ARMS if parse_arm(arm)[0] in (NONE, *offered))


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
    run: int = 0  # which of the --repeats runs (each with fresh services)
    ttft_seconds: float = 0.0  # the worker's time to the first token (0: not known)


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


# -- paired ratios ------------------------------------------------------------------------------------------------

Key = tuple[int, str, str]  # (run, segment, prompt_id): one prompt in one run


def key(s: Sample) -> Key:
    return s.run, s.segment, s.prompt_id


@dataclass(frozen=True)
class PromptRatio:
    """One prompt's paired ratio, and its weight in a mean (the baseline's tokens on that prompt)."""

    key: Key
    ratio: float
    tokens: int


def paired(samples: Sequence[Sample], arm: str, baseline: str = NONE, segment: str | None = None) -> list[PromptRatio]:
    """Per prompt (of ``segment``, or all), ``arm``'s decode rate over ``baseline``'s on that prompt in the same run;
    prompts where either rate is 0 (no tokens, no time) are left out."""
    rates: dict[str, dict[Key, list[Sample]]] = {arm: {}, baseline: {}}
    for s in samples:
        if s.arm in rates and (segment is None or s.segment == segment):
            rates[s.arm].setdefault(key(s), []).append(s)
    out = []
    for k, base in rates[baseline].items():
        mine, theirs = rate(rates[arm].get(k, [])), rate(base)
        if mine.per_second > 0 and theirs.per_second > 0:
            out.append(PromptRatio(k, ratio(mine, theirs), theirs.tokens))
    return out


def divide(numerator: Sequence[PromptRatio], denominator: Sequence[PromptRatio]) -> list[PromptRatio]:
    """Per prompt in both: numerator / denominator (adaptive's ratio over the oracle's, say)."""
    below = {r.key: r.ratio for r in denominator if r.ratio > 0}
    return [PromptRatio(r.key, r.ratio / below[r.key], r.tokens) for r in numerator if r.key in below]


def paired_ttft(samples: Sequence[Sample], arm: str, baseline: str) -> list[PromptRatio]:
    """Per prompt, ``arm``'s time to first token over ``baseline``'s on that prompt in the same run (lower is
    better); prompts where either is not known are left out."""
    first: dict[str, dict[Key, float]] = {arm: {}, baseline: {}}
    for s in samples:
        if s.arm in first and s.ttft_seconds > 0:
            first[s.arm][key(s)] = s.ttft_seconds
    return [PromptRatio(k, first[arm][k] / t, 1) for k, t in first[baseline].items() if k in first[arm]]


def halves(samples: Sequence[Sample]) -> dict[tuple[str, str], int]:
    """(segment, prompt id) -> 0 or 1: each segment's prompts in id order, alternately (a prompt is in the same half
    in every run)."""
    ids: dict[str, set[str]] = {}
    for s in samples:
        ids.setdefault(s.segment, set()).add(s.prompt_id)
    return {(segment, p): i % 2 for segment, prompts in ids.items() for i, p in enumerate(sorted(prompts))}


def cross_fitted(samples: Sequence[Sample], statics: Sequence[str], per_segment: bool) -> list[PromptRatio]:
    """Each prompt's ratio under the static arm chosen on the other half of the prompts (``halves``): per segment
    (the oracle's choice) or one arm over every segment (the best static arm's, ``none`` aside)."""
    half = halves([s for s in samples if s.arm == NONE])
    ratios = {arm: paired(samples, arm, NONE) for arm in statics}
    scope: Callable[[Key], str] = (lambda k: k[1]) if per_segment else (lambda k: "")
    candidates = list(statics) if per_segment else [a for a in statics if a != NONE]
    out: list[PromptRatio] = []
    for group in {scope(r.key) for r in ratios.get(NONE, [])}:
        for h in (0, 1):

            def in_half(r: PromptRatio, wanted: int, group: str = group) -> bool:
                return scope(r.key) == group and half.get((r.key[1], r.key[2])) == wanted

            chosen = max(
                candidates,
                key=lambda arm, h=h: median_ratio([r for r in ratios[arm] if in_half(r, 1 - h)]),  # type: ignore[misc]
                default=NONE,
            )
            out += [r for r in ratios.get(chosen, []) if in_half(r, h)]
    return out


def median_ratio(ratios: Sequence[PromptRatio]) -> float:
    return statistics.median(r.ratio for r in ratios) if ratios else 0.0


def geomean_ratio(ratios: Sequence[PromptRatio]) -> float:
    """exp of the tokens-weighted mean log ratio: each prompt counts by its tokens, a slow one by its ratio only."""
    weight = sum(r.tokens for r in ratios if r.ratio > 0)
    if weight <= 0:
        return 0.0
    return math.exp(sum(r.tokens * math.log(r.ratio) for r in ratios if r.ratio > 0) / weight)


Statistic = Callable[[Sequence[PromptRatio]], float]


def bootstrap(ratios: Sequence[PromptRatio], statistic: Statistic, seed: int = SEED, resamples: int = RESAMPLES,
              level: float = LEVEL) -> tuple[float, float]:  # fmt: skip
    """The percentile interval holding ``level`` of ``statistic`` over ``resamples`` resamplings of the prompts (with
    replacement; seeded, so the same prompts and seed give the same interval). (0, 0) without prompts."""
    if not ratios:
        return 0.0, 0.0
    rng = random.Random(seed)
    values = sorted(statistic(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1.0 - level) / 2
    return values[math.floor(tail * (resamples - 1))], values[math.ceil((1.0 - tail) * (resamples - 1))]


@dataclass(frozen=True)
class Figure:
    """One paired figure: the median of the per-prompt ratios and their tokens-weighted geometric mean, each with its
    bootstrap interval, over ``prompts`` prompts."""

    median: float
    interval: tuple[float, float]
    geomean: float
    geomean_interval: tuple[float, float]
    prompts: int


def figure(ratios: Sequence[PromptRatio], seed: int = SEED, means: bool = True) -> Figure:
    """``means`` false leaves the geometric mean out (0.0): the per-arm tables need only the medians."""
    mean = geomean_ratio(ratios) if means else 0.0
    mean_interval = bootstrap(ratios, geomean_ratio, seed) if means else (0.0, 0.0)
    return Figure(median_ratio(ratios), bootstrap(ratios, median_ratio, seed), mean, mean_interval, len(ratios))


def arm_vs_baseline(samples: Sequence[Sample], arm: str, baseline: str = NONE, segment: str | None = None,
                    seed: int = SEED, means: bool = True) -> Figure:  # fmt: skip
    """One arm's figure over its baseline on ``segment`` (None: every prompt): the paired median and mean."""
    return figure(paired(samples, arm, baseline, segment), seed, means)


# -- the report's figures -----------------------------------------------------------------------------------------


def summarize(samples: Sequence[Sample], seed: int = SEED) -> dict[str, Any]:
    """bench.json's paired figures: ``summary`` (medians), ``intervals``, ``geomeans``, ``geomean_intervals``,
    ``segments``, ``arms_vs_none`` (+ ``_interval``), ``mismatches``; the pooled figures under ``totals``."""
    statics = [arm for arm in STATIC_ARMS if by(samples, arm)]
    per_segment: dict[str, dict[str, Any]] = {}
    oracle: list[PromptRatio] = []
    for segment in segments_of(samples):
        arms = {arm: arm_vs_baseline(samples, arm, NONE, segment, seed, means=False) for arm in statics}
        oracle_arm = max(arms, key=lambda a: arms[a].median)  # ties: the first listed (none first)
        chosen = paired(samples, oracle_arm, NONE, segment)
        oracle += chosen
        none_rates = [s.tokens / s.decode_seconds for s in by(samples, NONE, segment) if s.decode_seconds > 0]
        per_segment[segment] = {
            "oracle_arm": oracle_arm,
            **flat("oracle_vs_none", figure(chosen, seed)),
            **flat("adaptive_vs_none", arm_vs_baseline(samples, ADAPTIVE, NONE, segment, seed)),
            **flat("adaptive_warm_vs_none", arm_vs_baseline(samples, ADAPTIVE_WARM, WARM_BASELINE, segment, seed)),
            "none_tokens_per_second": statistics.median(none_rates) if none_rates else 0.0,
            "prompts": arms[NONE].prompts if NONE in arms else 0,
            "arms_vs_none": {arm: f.median for arm, f in arms.items()},
            "arms_vs_none_interval": {arm: list(f.interval) for arm, f in arms.items()},
        }
    overall = {arm: arm_vs_baseline(samples, arm, NONE, None, seed, means=False) for arm in statics}
    best_static = max((a for a in overall if a != NONE), key=lambda a: overall[a].median, default=NONE)
    adaptive = paired(samples, ADAPTIVE, NONE)
    warm = paired(samples, ADAPTIVE_WARM, WARM_BASELINE)
    best = paired(samples, best_static, NONE)
    oracle_cross, best_cross = cross_fitted(samples, statics, True), cross_fitted(samples, statics, False)
    figures = {
        "adaptive_vs_none": figure(adaptive, seed),
        "adaptive_warm_vs_none": figure(warm, seed),
        "best_static_vs_none": figure(best, seed),
        "oracle_vs_none": figure(oracle, seed),
        "adaptive_vs_oracle": figure(divide(adaptive, oracle), seed),
        "adaptive_warm_vs_oracle": figure(divide(warm, oracle), seed),
        "adaptive_warm_vs_best_static": figure(divide(warm, best), seed),
        "oracle_cross_vs_none": figure(oracle_cross, seed),
        "best_static_cross_vs_none": figure(best_cross, seed),
        "adaptive_vs_oracle_cross": figure(divide(adaptive, oracle_cross), seed),
        "adaptive_warm_vs_oracle_cross": figure(divide(warm, oracle_cross), seed),
        "adaptive_warm_vs_best_static_cross": figure(divide(warm, best_cross), seed),
        "controlled_none_vs_uncontrolled": figure(paired(samples, AA_CONTROLLED, AA_UNCONTROLLED), seed),
        "ttft_adaptive_vs_none": figure(
            paired_ttft(samples, ADAPTIVE, NONE) + paired_ttft(samples, ADAPTIVE_WARM, WARM_BASELINE), seed
        ),
    }
    equal, mismatches = outputs_equal(samples)
    median = {name: f.median for name, f in figures.items()}
    summary = {
        "adaptive_vs_none": median["adaptive_vs_none"],
        "adaptive_warm_vs_none": median["adaptive_warm_vs_none"],
        "best_static": best_static,
        "best_static_vs_none": median["best_static_vs_none"],
        "oracle_vs_none": median["oracle_vs_none"],
        "adaptive_vs_oracle": median["adaptive_vs_oracle"],
        "adaptive_warm_vs_oracle": median["adaptive_warm_vs_oracle"],
        "adaptive_warm_vs_best_static": median["adaptive_warm_vs_best_static"],
        "oracle_cross_vs_none": median["oracle_cross_vs_none"],
        "best_static_cross_vs_none": median["best_static_cross_vs_none"],
        "adaptive_vs_oracle_cross": median["adaptive_vs_oracle_cross"],
        "adaptive_warm_vs_oracle_cross": median["adaptive_warm_vs_oracle_cross"],
        "adaptive_warm_vs_best_static_cross": median["adaptive_warm_vs_best_static_cross"],
        "controlled_none_vs_uncontrolled": median["controlled_none_vs_uncontrolled"],
        "ttft_adaptive_vs_none": median["ttft_adaptive_vs_none"],
        "outputs_equal": equal,
    }
    summary |= {f"{name}_interval": list(figures[name].interval) for name in AA_AND_TTFT}
    return {
        "summary": summary,
        "intervals": {name: list(f.interval) for name, f in figures.items()},
        "geomeans": {name: f.geomean for name, f in figures.items()},
        "geomean_intervals": {name: list(f.geomean_interval) for name, f in figures.items()},
        "prompts": {name: f.prompts for name, f in figures.items()},
        "segments": per_segment,
        "arms_vs_none": {arm: f.median for arm, f in overall.items()},
        "arms_vs_none_interval": {arm: list(f.interval) for arm, f in overall.items()},
        "calibration": {segment: calibration(samples, segment) for segment in per_segment},
        "decisions": {segment: decisions(samples, segment) for segment in per_segment},
        "totals": totals(samples),
        "mismatches": mismatches,
    }


AA_AND_TTFT = ("controlled_none_vs_uncontrolled", "ttft_adaptive_vs_none")  # their intervals in ``summary`` too


def flat(name: str, f: Figure) -> dict[str, Any]:
    """A segment's entries for one figure: ``name`` (the median), ``name_interval``, ``name_geomean`` and
    ``name_geomean_interval``."""
    return {name: f.median, f"{name}_interval": list(f.interval), f"{name}_geomean": f.geomean,
            f"{name}_geomean_interval": list(f.geomean_interval)}  # fmt: skip


def totals(samples: Sequence[Sample]) -> dict[str, Any]:
    """The pooled figures (each arm's total tokens over its total decode seconds, over ``none``'s), as the bench
    reported them before the paired medians: one stall in a short request can dominate them."""
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
    summary = {
        "adaptive_vs_none": adaptive,
        "adaptive_warm_vs_none": warm,
        "best_static": best_static,
        "best_static_vs_none": pooled.get(best_static, 1.0),
        "oracle_vs_none": oracle,
        "adaptive_vs_oracle": adaptive / oracle if oracle else 0.0,
        "adaptive_warm_vs_oracle": warm / oracle if oracle else 0.0,
        "adaptive_warm_vs_best_static": warm / pooled[best_static] if pooled.get(best_static) else 0.0,
    }
    return {"method": "pooled: total tokens / total decode seconds per arm, over none's", "summary": summary,
            "segments": per_segment, "arms_vs_none": pooled}  # fmt: skip


ADAPTIVE_PASSES = (("cold", ADAPTIVE, NONE), ("warm", ADAPTIVE_WARM, WARM_BASELINE))


def calibration(samples: Sequence[Sample], segment: str) -> dict[str, Any]:
    """Per adaptive pass: the median over the segment's requests that speculated of realised paired ratio / the
    expected speedup their decision promised (1.0: the controller's model of the world is true; None: no request
    speculated), and how many requests that is."""
    out: dict[str, Any] = {}
    for name, arm, baseline in ADAPTIVE_PASSES:
        realised = {r.key: r.ratio for r in paired(samples, arm, baseline, segment)}
        values = [realised[key(s)] / s.expected_speedup for s in by(samples, arm, segment)
                  if s.drafter != NONE and s.expected_speedup > 0 and key(s) in realised]  # fmt: skip
        out[name] = statistics.median(values) if values else None
        out[f"{name}_requests"] = len(values)
    return out


def plan_name(s: Sample) -> str:
    return NONE if s.drafter == NONE else f"{s.drafter}:{s.k}"


def first_at_final_plan(ordered: Sequence[Sample]) -> tuple[str | None, int | None]:
    """The final plan ("drafter:K", the last request's that was not a probe) and the order of the first request from
    which every later request that was not a probe ran it; (None, None) when every request was a probe."""
    chosen = [s for s in ordered if not s.exploration]
    if not chosen:
        return None, None
    final = plan_name(chosen[-1])
    start = len(chosen) - 1
    while start > 0 and plan_name(chosen[start - 1]) == final:
        start -= 1
    return final, chosen[start].order


def decisions(samples: Sequence[Sample], segment: str) -> dict[str, Any]:
    """Per adaptive pass on ``segment``: requests per drafter, probes, and per run the final plan and the first
    request (its ``order``) at it."""
    out: dict[str, Any] = {}
    for name, arm, _ in ADAPTIVE_PASSES:
        mine = by(samples, arm, segment)
        runs = sorted({s.run for s in mine})
        settled = [first_at_final_plan(sorted((s for s in mine if s.run == r), key=lambda s: s.order)) for r in runs]
        out[name] = {
            "requests": len(mine),
            "drafters": dict(Counter(s.drafter for s in mine)),
            "probes": sum(s.exploration for s in mine),
            "final_plan": [plan for plan, _ in settled],
            "first_at_final_plan": [order for _, order in settled],
        }
    return out


def headline(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures compared across repeats: the headline ratios and the best static arm."""
    return {"best_static": summary["best_static"], **{name: summary[name] for name in HEADLINE}}


def spread(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per headline ratio over the runs: min, max, and the largest |value - mean| / mean."""
    out: dict[str, dict[str, float]] = {}
    for name in HEADLINE:
        values = [float(r[name]) for r in runs]
        mean = statistics.fmean(values) if values else 0.0
        deviation = max((abs(v - mean) / mean for v in values), default=0.0) if mean > 0 else 0.0
        out[name] = {"min": min(values, default=0.0), "max": max(values, default=0.0),
                     "max_relative_deviation": deviation}  # fmt: skip
    return out


def repeats(samples: Sequence[Sample], summary: dict[str, Any], seed: int = SEED) -> dict[str, Any]:
    """bench.json's ``repeats``: each run's headline figures (its own paired medians) and their spread. ``summary``
    is ``summarize``'s over every run: with one run, that run's."""
    runs = sorted({s.run for s in samples})
    if len(runs) <= 1:
        figures = [headline(summary)]
    else:
        figures = [headline(summarize([s for s in samples if s.run == r], seed)["summary"]) for r in runs]
    return {"runs": figures, "spread": spread(figures)}
