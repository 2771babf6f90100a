"""bench.json, BENCH.md and the plots of one `specd bench` run."""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specd.bench.measure import STATIC_ARMS, summarize
from specd.bench.plot import plot_decisions, plot_speedups


@dataclass(frozen=True)
class Written:
    summary: dict[str, Any]
    text: str  # what the console shows


def cost_comparison(learned: dict[str, Any], isolated: dict[str, Any]) -> dict[str, Any]:
    """The controller's learned costs at batch 1 beside the engine's own, with learned / isolated."""
    bucket = next((b for b in learned.get("buckets", []) if int(b.get("batch_bucket", 0)) == 1), None)
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
        "segments": derived["segments"],
        "arms_vs_none": derived["arms_vs_none"],
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
        "batches": list(options.batches),
        "drift": options.drift,
        "target": str(options.target),
        "draft": str(options.draft),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "seconds": round(seconds, 1),
    }


def headline(document: dict[str, Any], out: Path) -> str:
    s = document["summary"]
    lines = [
        f"adaptive {s['adaptive_vs_none']:.2f}x none (cold), {s['adaptive_warm_vs_none']:.2f}x (warm); "
        f"oracle {s['oracle_vs_none']:.2f}x; best static {s['best_static']} {s['best_static_vs_none']:.2f}x",
        f"adaptive/oracle {s['adaptive_vs_oracle']:.3f} (cold), {s['adaptive_warm_vs_oracle']:.3f} (warm); "
        f"warm/best static {s['adaptive_warm_vs_best_static']:.3f}; greedy outputs equal: {s['outputs_equal']}",
        f"wrote {out / 'bench.json'}, {out / 'BENCH.md'}, {out / 'speedup_by_segment.png'}, "
        f"{out / 'decisions_over_time.png'}",
    ]
    return "\n".join(lines)


def render(d: dict[str, Any]) -> str:
    s, st = d["summary"], d["settings"]
    lines = [
        "# specd bench",
        "",
        f"{st['machine']}; dtype {st['dtype']}; {st['prompts_per_segment']} prompts per segment (max "
        f"{st['max_new_tokens']} new tokens), {st['repeats']} repeat(s); {st['seconds']:.0f} s. Ratios are decode "
        "tokens/s over `none`'s on the same prompts in the same run.",
        "",
        "| figure | value |",
        "|---|---|",
        *(f"| {k} | {fmt(v)} |" for k, v in s.items()),
        "",
        "## Per segment",
        "",
        "| segment | none tok/s | oracle arm | oracle | adaptive (cold) | adaptive (warm) | "
        + " | ".join(STATIC_ARMS[1:])
        + " |",
        "|---|---|---|---|---|---|" + "---|" * (len(STATIC_ARMS) - 1),
    ]
    for name, seg in d["segments"].items():
        arms = " | ".join(f"{seg['arms_vs_none'].get(a, 0):.2f}" for a in STATIC_ARMS[1:])
        lines.append(
            f"| {name} | {seg['none_tokens_per_second']:.0f} | {seg['oracle_arm']} | {seg['oracle_vs_none']:.2f} | "
            f"{seg['adaptive_vs_none']:.2f} | {seg['adaptive_warm_vs_none']:.2f} | {arms} |"
        )
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


def fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)
