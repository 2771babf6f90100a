"""bench.json, BENCH.md and the plots of one `specd bench` run."""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specd.bench.measure import HEADLINE, STATIC_ARMS, repeats, summarize
from specd.bench.noise import worker_seed
from specd.bench.plot import plot_decisions, plot_speedups


@dataclass(frozen=True)
class Written:
    summary: dict[str, Any]
    text: str  # what the console shows


def cost_comparison(learned: dict[str, Any], isolated: dict[str, Any]) -> dict[str, Any]:
    """The controller's learned costs at batch 1, of greedy requests (the engine alone is timed greedy), beside the
    engine's own, with learned / isolated."""
    bucket = next((b for b in learned.get("buckets", []) if int(b.get("batch_bucket", 0)) == 1
                   and b.get("mode", "greedy") == "greedy"), None)  # fmt: skip
    if bucket is None:
        return {"learned": None, "isolated": isolated, "ratios": {}}
    v = [float(x) for x in bucket.get("verify_cost", [])]
    measured = [float(x) for x in bucket.get("verify_rounds", [])]
    ratios = {"step_seconds": float(bucket.get("step_seconds", 0.0)) / isolated["step_seconds"]}
    c = bucket.get("cost_ratio", {}).get("draft")
    if c is not None and isolated["c_draft"]:
        ratios["c_draft"] = float(c) / isolated["c_draft"]
    for n in range(1, min(len(v), len(isolated["v"]))):
        if n < len(measured) and measured[n] and isolated["v"][n]:
            ratios[f"v({n})"] = v[n] / isolated["v"][n]
    return {"learned": {"step_seconds": bucket.get("step_seconds"), "c_draft": c, "v": v, "v_rounds": measured},
            "isolated": isolated, "ratios": ratios}  # fmt: skip


def write_report(run: Any, options: Any, out: Path) -> Written:
    derived = summarize(run.samples)
    costs = cost_comparison(run.learned_costs, run.isolated_costs)
    document = {
        "summary": derived["summary"],
        "intervals": derived["intervals"],
        "geomeans": derived["geomeans"],
        "geomean_intervals": derived["geomean_intervals"],
        "prompts": derived["prompts"],
        "totals": derived["totals"],
        "segments": derived["segments"],
        "arms_vs_none": derived["arms_vs_none"],
        "arms_vs_none_interval": derived["arms_vs_none_interval"],
        "calibration": derived["calibration"],
        "decisions": derived["decisions"],
        "static_arms": list(run.arms),
        "noise": noise(options),
        "repeats": repeats(run.samples, derived["summary"]),
        "mismatches": derived["mismatches"],
        "batch": run.batch,
        "batch_decisions": run.batch_decisions,
        "drift": run.drift,
        "costs": costs,
        "settings": settings(options, run.seconds),
        "samples": [{k: v for k, v in s.__dict__.items() if k != "text"} for s in run.samples],
    }
    (out / "bench.json").write_text(json.dumps(document, indent=2) + "\n")
    plot_speedups(derived["segments"], out / "speedup_by_segment.png")
    plot_decisions(run.samples, out / "decisions_over_time.png", run.drift)
    markdown = render(document)
    (out / "BENCH.md").write_text(markdown)
    return Written(derived["summary"], headline(document, out))


def settings(options: Any, seconds: float) -> dict[str, Any]:
    return {
        "workloads": [str(p) for p in options.workloads],
        "prompts_per_segment": options.prompts_per_segment,
        "max_new_tokens": options.max_new_tokens,
        "dtype": options.dtype,
        "repeats": options.repeats,
        "noise": noise(options),
        "batches": list(options.batches),
        "drift": options.drift,
        "target": str(options.target),
        "draft": str(options.draft),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "seconds": round(seconds, 1),
    }


def noise(options: Any) -> dict[str, Any] | None:
    if options.noise is None:
        return None
    return options.noise.describe([worker_seed(options.seed, r) for r in range(options.repeats)])


def headline(document: dict[str, Any], out: Path) -> str:
    s, iv = document["summary"], document["intervals"]

    def x(name: str) -> str:
        return f"{s[name]:.2f}x [{iv[name][0]:.2f}, {iv[name][1]:.2f}]"

    def q(name: str) -> str:
        return f"{s[name]:.3f} [{iv[name][0]:.3f}, {iv[name][1]:.3f}]"

    lines = [
        "paired medians over prompts [bootstrap 95% interval]:",
        f"adaptive {x('adaptive_vs_none')} none (cold), {x('adaptive_warm_vs_none')} (warm); "
        f"oracle {x('oracle_vs_none')}; best static {s['best_static']} {x('best_static_vs_none')}",
        f"adaptive/oracle {q('adaptive_vs_oracle')} (cold), {q('adaptive_warm_vs_oracle')} (warm); "
        f"warm/best static {q('adaptive_warm_vs_best_static')}; greedy outputs equal: {s['outputs_equal']}",
        f"cross-fitted (chosen on one half of the prompts, scored on the other): adaptive/oracle "
        f"{q('adaptive_vs_oracle_cross')} (cold), {q('adaptive_warm_vs_oracle_cross')} (warm); warm/best static "
        f"{q('adaptive_warm_vs_best_static_cross')}",
        f"A/A: the controlled worker, every decision none, over the uncontrolled one "
        f"{q('controlled_none_vs_uncontrolled')}; time to first token, adaptive over none {q('ttft_adaptive_vs_none')}",
    ]
    spread = document["repeats"]["spread"]
    if len(document["repeats"]["runs"]) > 1:
        lines.append(f"over {len(document['repeats']['runs'])} runs: adaptive (warm) "
                     f"{spread['adaptive_warm_vs_none']['min']:.2f}-{spread['adaptive_warm_vs_none']['max']:.2f}x, "
                     "largest deviation from the mean of any headline ratio "
                     f"{max(v['max_relative_deviation'] for v in spread.values()):.1%}")  # fmt: skip
    lines.append(f"wrote {out / 'bench.json'}, {out / 'BENCH.md'}, {out / 'speedup_by_segment.png'}, "
                 f"{out / 'decisions_over_time.png'}")  # fmt: skip
    return "\n".join(lines)


def render(d: dict[str, Any]) -> str:
    s, st, totals = d["summary"], d["settings"], d["totals"]["summary"]
    noise = d.get("noise")
    statics = [a for a in d.get("static_arms", STATIC_ARMS) if a != "none"]
    lines = [
        "# specd bench",
        "",
        f"{st['machine']}; dtype {st['dtype']}; {st['prompts_per_segment']} prompts per segment (max "
        f"{st['max_new_tokens']} new tokens), {st['repeats']} run(s), each with fresh services; "
        f"{st['seconds']:.0f} s. "
        + (f"Noise: the worker stalled {noise['share']:.0%} of requests for {noise['ms']:g} ms each. " if noise else "")
        + "Every figure is paired: per prompt, an arm's decode tokens/s over `none`'s on the same prompt in the same "
        "rotation (the warm pass over `none` measured beside it); the figure is the median over prompts, [the "
        "bootstrap 95% interval], with the tokens-weighted geometric mean beside it. Totals (pooled tokens over "
        "pooled decode seconds) are shown for the record: one stall can dominate them.",
        "",
        "| figure | paired median | 95% interval | geometric mean | totals (pooled) |",
        "|---|---|---|---|---|",
    ]
    for name, value in s.items():
        if name.endswith("_interval"):
            continue  # beside its figure below
        if name in d["intervals"]:
            iv, gm, gi = d["intervals"][name], d["geomeans"][name], d["geomean_intervals"][name]
            lines.append(f"| {name} | {value:.3f} | [{iv[0]:.3f}, {iv[1]:.3f}] | {gm:.3f} [{gi[0]:.3f}, {gi[1]:.3f}] "
                         f"| {fmt(totals.get(name))} |")  # fmt: skip
        else:
            lines.append(f"| {name} | {fmt(value)} | | | {fmt(totals.get(name, ''))} |")
    lines += [
        "",
        "## Per segment (paired medians [95% interval])",
        "",
        "| segment | pairs | none tok/s | oracle arm | oracle | adaptive (cold) | adaptive (warm) | "
        + " | ".join(statics)
        + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(statics),
    ]
    for name, seg in d["segments"].items():
        arms = " | ".join(f"{seg['arms_vs_none'].get(a, 0):.2f}" for a in statics)
        lines.append(
            f"| {name} | {seg['prompts']} | {seg['none_tokens_per_second']:.0f} | {seg['oracle_arm']} | "
            f"{with_interval(seg, 'oracle_vs_none')} | {with_interval(seg, 'adaptive_vs_none')} | "
            f"{with_interval(seg, 'adaptive_warm_vs_none')} | {arms} |"
        )
    lines += [
        "",
        "## Per segment, totals (pooled tokens / pooled decode seconds, for the record)",
        "",
        "| segment | oracle arm | oracle | adaptive (cold) | adaptive (warm) |",
        "|---|---|---|---|---|",
    ]
    for name, seg in d["totals"]["segments"].items():
        lines.append(f"| {name} | {seg['oracle_arm']} | {seg['oracle_vs_none']:.2f} | {seg['adaptive_vs_none']:.2f} | "
                     f"{seg['adaptive_warm_vs_none']:.2f} |")  # fmt: skip
    lines += [
        "",
        "## Calibration and decisions per segment",
        "",
        "Calibration: median over the requests that speculated of realised paired ratio / the expected speedup the "
        "decision promised (1.0: the controller's model is true). Final plan @ order: the plan the last non-probe "
        "request ran, and the first request (its place in the pass) from which every later non-probe request ran it "
        "(one per run).",
        "",
        "| segment | calibration cold (n) | calibration warm (n) | cold: drafters, probes | cold: final plan @ order "
        "| warm: drafters, probes | warm: final plan @ order |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in d["segments"]:
        cal, dec = d["calibration"][name], d["decisions"][name]
        lines.append(f"| {name} | {fmt(cal['cold'])} ({cal['cold_requests']}) | {fmt(cal['warm'])} "
                     f"({cal['warm_requests']}) | {plans(dec['cold'])} | {settled(dec['cold'])} | {plans(dec['warm'])} "
                     f"| {settled(dec['warm'])} |")  # fmt: skip
    runs = d["repeats"]["runs"]
    if len(runs) > 1:
        spread = d["repeats"]["spread"]
        lines += [
            "",
            f"## Repeats ({len(runs)} runs, each with fresh services)",
            "",
            "| run | best static | " + " | ".join(HEADLINE) + " |",
            "|---|---|" + "---|" * len(HEADLINE),
        ]
        for i, r in enumerate(runs, 1):
            lines.append(f"| {i} | {r['best_static']} | " + " | ".join(f"{r[h]:.3f}" for h in HEADLINE) + " |")
        lines += ["| min-max | | " + " | ".join(f"{spread[h]['min']:.3f}-{spread[h]['max']:.3f}" for h in HEADLINE)
                  + " |", "| max deviation from the mean | | "
                  + " | ".join(f"{spread[h]['max_relative_deviation']:.1%}" for h in HEADLINE) + " |"]  # fmt: skip
    costs = d["costs"]
    if costs.get("learned"):
        iso, learned = costs["isolated"], costs["learned"]
        n = min(len(learned["v"]), len(iso["v"]))
        lines += ["", "## Costs: learned by the controller vs the engine alone (batch 1)", "",
                  "| | target step | c(draft) | " + " | ".join(f"v({i})" for i in range(1, n)) + " |",
                  "|---|---|---|" + "---|" * (n - 1),
                  f"| learned | {learned['step_seconds'] * 1e3:.2f} ms | {fmt(learned['c_draft'])} | "
                  + " | ".join(f"{learned['v'][i]:.2f}" + ("" if i < len(learned['v_rounds']) and learned['v_rounds'][i]
                                                            else "*") for i in range(1, n)) + " |",
                  f"| engine alone | {iso['step_seconds'] * 1e3:.2f} ms | {iso['c_draft']:.3f} | "
                  + " | ".join(f"{iso['v'][i]:.2f}" for i in range(1, n)) + " |",
                  "", "(* interpolated: no round drafted n). learned / alone: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in costs["ratios"].items())]  # fmt: skip
    if d["batch"]:
        names = list(next(iter(d["batch"].values())))
        lines += [
            "",
            "## Batch sweep (tokens/s of the worker; speedup over none)",
            "",
            "| batch | " + " | ".join(names) + " | adaptive's drafters |",
            "|---|" + "---|" * (len(names) + 1),
        ]
        for b, rates in d["batch"].items():
            base = rates.get("none") or 1.0
            cells = " | ".join(f"{rates[a]:.0f} ({rates[a] / base:.2f}x)" for a in names)
            lines.append(f"| {b} | {cells} | {d['batch_decisions'].get(b, {})} |")
    if d["drift"]:
        dr = d["drift"]
        lines += ["", "## Drift", "",
                  f"Segment `drift`: structured prompts (greedy), then adversarial ones at "
                  f"T = {dr['timeline'][-1].get('temperature', 0.0):g}, where the first phase's drafter stops paying. "
                  f"Before the switch the "
                  f"controller chose `{dr['before']}`; requests after the switch until it stopped choosing it for "
                  f"good: {dr['requests_to_switch']} ({fmt(dr['seconds_to_switch'])} s; learning half-life "
                  f"{dr['half_life_seconds']:.0f} s). Alarms: "
                  + (", ".join(f"{a.get('drafter')} {a.get('direction')} {fmt(a.get('alpha_before'))} -> "
                               f"{fmt(a.get('alpha_since'))}" for a in dr["alarms"]) or "none")]  # fmt: skip
    if d["mismatches"]:
        lines += ["", "Greedy outputs that differ from none's: " + ", ".join(d["mismatches"][:20])]
    return "\n".join(lines) + "\n"


def with_interval(seg: dict[str, Any], name: str) -> str:
    low, high = seg[f"{name}_interval"]
    return f"{seg[name]:.2f} [{low:.2f}, {high:.2f}]"


def plans(decision: dict[str, Any]) -> str:
    drafters = ", ".join(f"{k} {v}" for k, v in sorted(decision["drafters"].items()))
    return f"{drafters or '-'}; {decision['probes']} probes"


def settled(decision: dict[str, Any]) -> str:
    pairs = zip(decision["final_plan"], decision["first_at_final_plan"], strict=True)
    return ", ".join(f"{plan} @ {order}" for plan, order in pairs) or "-"


def fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
