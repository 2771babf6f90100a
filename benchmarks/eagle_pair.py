"""The shipped head against the shipped draft model: acceptance, drafting cost and speed, per workload.

For each shipped workload, greedy, through the engine's own round loop on the machine's default pass: target-only,
the draft model at each ``--ks`` and the ``eagle`` head at each, the arms of one prompt back to back in a rotated
order. Per workload and arm: α (accepted over drafted, pooled), c (drafting seconds per drafted token over the
target-only step's seconds, each prompt's own), the median per-prompt speedup over target-only with its 10-90 %
spread, and whether the output equalled target-only's (greedy: it must). Then, per workload, the best eagle arm
over the best draft-model arm (each the arm of highest median speedup), from the same prompts.

    python benchmarks/eagle_pair.py                            # shipped pair and head, 4 prompts per workload
    python benchmarks/eagle_pair.py --ks 2,4,6 --per-workload 6 --json out.json

JSON keys: ``workloads`` (per workload: per arm ``alpha``, ``cost_ratio``, ``speedup_median``, ``speedup_p10``,
``speedup_p90``, ``same_output``; and ``best_eagle_over_best_draft``), ``runner``, ``cpu``, ``tokens``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: the repository root is not on the path, benchmarks/ is
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.decode_loop import cpu_model
from benchmarks.tree_lookup import quantiles
from decoder.engine import SpeculativeDecoder
from decoder.heads import load_head
from decoder.models import load_model
from decoder.request_stop import StopConditions
from decoder.runners import KVPool
from decoder.sampling import SamplingParams
from specd_api.plan import requested
from workloads import load_all

REPO = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(REPO / "models/reference/target"))
    parser.add_argument("--draft", default=str(REPO / "models/reference/draft"))
    parser.add_argument("--head", default=str(REPO / "models/reference/eagle"))
    parser.add_argument("--ks", default="2,4,6")
    parser.add_argument("--per-workload", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    cpu = torch.device("cpu")
    target = load_model(args.target, cpu, torch.float32)
    engine = SpeculativeDecoder(target, load_model(args.draft, cpu, torch.float32), head=load_head(args.head, target))
    runner = KVPool(target, 1).forward_pass.name
    ks = [int(k) for k in args.ks.split(",")]
    arms = ["none", *(f"draft:{k}" for k in ks), *(f"eagle:{k}" for k in ks)]
    rules = StopConditions(max_new_tokens=args.tokens)
    results: dict[str, Any] = {}
    all_same = True
    for name, prompts in sorted(load_all(REPO / "workloads").items()):
        speedups: dict[str, list[float]] = {a: [] for a in arms[1:]}
        costs: dict[str, list[float]] = {a: [] for a in arms[1:]}
        counts = {a: [0, 0] for a in arms[1:]}  # accepted, drafted
        same = {a: 0 for a in arms[1:]}
        for i, prompt in enumerate(prompts[: args.per_workload]):
            ids = target.tokenizer(prompt.prompt, add_special_tokens=True)["input_ids"][-192:]
            engine.decode(ids, SamplingParams(), rules, requested("eagle", ks[-1]))  # warm-up
            seconds, outputs, stats = {}, {}, {}
            for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:  # rotated order
                drafter, _, k = arm.partition(":")
                started = time.perf_counter()
                result = engine.decode(ids, SamplingParams(), rules, requested(drafter, int(k or 0)))
                seconds[arm], outputs[arm], stats[arm] = time.perf_counter() - started, result.token_ids, result.stats
            step = seconds["none"] / max(len(outputs["none"]), 1)
            for arm in arms[1:]:
                s = stats[arm]
                speedups[arm].append(seconds["none"] / seconds[arm])
                costs[arm].append(s.draft_seconds / max(s.num_drafted, 1) / step)
                counts[arm][0] += s.num_accepted
                counts[arm][1] += s.num_drafted
                same[arm] += outputs[arm] == outputs["none"]
        row: dict[str, Any] = {}
        for arm in arms[1:]:
            median, p10, p90 = quantiles(speedups[arm])
            row[arm] = {
                "alpha": counts[arm][0] / max(counts[arm][1], 1),
                "cost_ratio": quantiles(costs[arm])[0],
                "speedup_median": median, "speedup_p10": p10, "speedup_p90": p90,
                "same_output": [same[arm], len(speedups[arm])],
            }  # fmt: skip
            all_same &= same[arm] == len(speedups[arm])
        best = {d: max((a for a in arms[1:] if a.startswith(d)), key=lambda a: row[a]["speedup_median"])
                for d in ("draft", "eagle")}  # fmt: skip
        per_prompt = [e / d for e, d in zip(speedups[best["eagle"]], speedups[best["draft"]], strict=True)]
        ratio = dict(zip(("median", "p10", "p90"), quantiles(per_prompt), strict=True))
        results[name] = {"arms": row, "best_eagle_over_best_draft": {**ratio, "arms": best}}
        print(f"{name}:", flush=True)
        for arm in arms[1:]:
            r = row[arm]
            print(f"  {arm:<9} α {r['alpha']:.3f}  c {r['cost_ratio']:.3f}  {r['speedup_median']:.2f}x "
                  f"[{r['speedup_p10']:.2f}, {r['speedup_p90']:.2f}]  same {r['same_output'][0]}/"
                  f"{r['same_output'][1]}", flush=True)  # fmt: skip
        print(f"  best eagle ({best['eagle']}) over best draft ({best['draft']}): {ratio['median']:.2f}x "
              f"[{ratio['p10']:.2f}, {ratio['p90']:.2f}]", flush=True)  # fmt: skip
    print(f"({runner} pass, {cpu_model()}, {args.tokens} tokens per prompt)")
    if args.json:
        doc = {"workloads": results, "runner": runner, "cpu": cpu_model(), "tokens": args.tokens, "ks": ks}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all_same else 1


if __name__ == "__main__":
    sys.exit(main())
