"""Prompt lookup's trees against its chains: does verifying several matches in one pass pay here?

For each shipped workload, greedy, prompt lookup at ``--k`` with ``branches`` 1 (a chain) and each of ``--branches``
(a tree of that many matches), through the engine's own round loop on the machine's default pass, the arms of one
prompt back to back in a rotated order. Per workload and arm: the median per-prompt speedup over the chain with its
10-90 % spread, tokens emitted per round, and whether the output equalled the chain's (greedy: it must). Beside
them, the pass's cost of a tree's rows against a chain's of the same count (a tree's pass costs what its rows cost:
``v_tree_over_chain`` near 1).

    python benchmarks/tree_lookup.py                          # shipped pair, 3 prompts per workload, 48 tokens
    python benchmarks/tree_lookup.py --branches 2,4 --json out.json

JSON keys: ``workloads`` (per workload, per arm: ``speedup_median``, ``speedup_p10``, ``speedup_p90``,
``tokens_per_round``, ``same_output``), ``overall`` (per arm: the median over every prompt, p10, p90),
``v_tree_over_chain``, ``runner``, ``cpu``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.decode_loop import cpu_model
from decoder.drafters import PromptLookupConfig
from decoder.engine import SpeculativeDecoder
from decoder.models import load_model
from decoder.request_stop import StopConditions
from decoder.runners import KVPool
from decoder.sampling import SamplingParams
from decoder.tree import DraftTree
from specd_api.plan import requested
from workloads import load_all

REPO = Path(__file__).resolve().parent.parent


def quantiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]  # noqa: E731
    return statistics.median(ordered), pick(0.1), pick(0.9)


def tree_cost(target: Any, rows: int = 9, repeats: int = 30) -> float:
    """A pass over a root and ``rows - 1`` nodes as a 3-wide tree against the same count as a chain (medians)."""
    pool = KVPool(target, 1)
    seq = pool.open()
    context = torch.randint(5, 200, (300,))
    width = 3
    tree = DraftTree(tuple(range(5, 4 + rows)), tuple(-1 if i < width else i - width for i in range(rows - 1)))
    ids = torch.tensor([7, *tree.tokens])
    times: dict[str, list[float]] = {"chain": [], "tree": []}
    with torch.inference_mode():
        seq.forward(context)
        for _ in range(repeats):
            for arm in ("chain", "tree"):
                started = time.perf_counter()
                seq.forward(ids, tree=tree if arm == "tree" else None)
                times[arm].append(time.perf_counter() - started)
                seq.truncate(300)
    return statistics.median(times["tree"]) / statistics.median(times["chain"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=str(REPO / "models/reference/target"))
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--branches", default="3", help="tree arms, comma-separated (the chain is always run)")
    parser.add_argument("--per-workload", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    arms = [1, *(int(b) for b in args.branches.split(","))]
    target = load_model(args.target, torch.device("cpu"), torch.float32)
    runner = KVPool(target, 1).forward_pass.name
    engines = {b: SpeculativeDecoder(target, prompt_lookup=PromptLookupConfig(branches=b)) for b in arms}
    rules = StopConditions(max_new_tokens=args.tokens)
    plan = requested("prompt_lookup", args.k)
    results: dict[str, Any] = {}
    every: dict[int, list[float]] = {b: [] for b in arms[1:]}
    for name, prompts in sorted(load_all(REPO / "workloads").items()):
        ratios: dict[int, list[float]] = {b: [] for b in arms[1:]}
        per_round: dict[int, list[float]] = {b: [] for b in arms}
        same = {b: 0 for b in arms[1:]}
        for i, prompt in enumerate(prompts[: args.per_workload]):
            ids = target.tokenizer(prompt.prompt, add_special_tokens=True)["input_ids"][-192:]
            engines[1].decode(ids, SamplingParams(), rules, plan)  # warm-up
            seconds, outputs = {}, {}
            for b in arms[i % len(arms) :] + arms[: i % len(arms)]:  # rotated order
                started = time.perf_counter()
                result = engines[b].decode(ids, SamplingParams(), rules, plan)
                seconds[b], outputs[b] = time.perf_counter() - started, result.token_ids
                per_round[b].append(len(result.token_ids) / max(result.stats.num_rounds, 1))
            for b in arms[1:]:
                ratios[b].append(seconds[1] / seconds[b])
                same[b] += outputs[b] == outputs[1]
                every[b].append(seconds[1] / seconds[b])
        results[name] = {
            str(b): {
                **dict(zip(("speedup_median", "speedup_p10", "speedup_p90"), quantiles(ratios[b]), strict=True)),
                "tokens_per_round": statistics.mean(per_round[b]),
                "same_output": [same[b], len(ratios[b])],
            }
            for b in arms[1:]
        } | {"1": {"tokens_per_round": statistics.mean(per_round[1])}}
        row = results[name]
        line = "  ".join(
            f"branches {b}: {row[str(b)]['speedup_median']:.2f}x [{row[str(b)]['speedup_p10']:.2f}, "
            f"{row[str(b)]['speedup_p90']:.2f}] {row[str(b)]['tokens_per_round']:.2f} tok/round, same {same[b]}/"
            f"{len(ratios[b])}"
            for b in arms[1:]
        )  # fmt: skip
        print(f"{name:<12} chain {row['1']['tokens_per_round']:.2f} tok/round  {line}", flush=True)
    overall = {str(b): dict(zip(("median", "p10", "p90"), quantiles(every[b]), strict=True)) for b in arms[1:]}
    cost = tree_cost(target)
    print("overall      " + "  ".join(f"branches {b}: {o['median']:.2f}x [{o['p10']:.2f}, {o['p90']:.2f}]"
                                      for b, o in overall.items()))  # fmt: skip
    print(f"a 9-row tree's pass over a 9-token chain's: {cost:.2f} ({runner} pass, {cpu_model()})")
    if args.json:
        doc = {"workloads": results, "overall": overall, "v_tree_over_chain": cost, "runner": runner,
               "cpu": cpu_model(), "k": args.k, "tokens": args.tokens}  # fmt: skip
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0 if all(r[str(b)]["same_output"][0] == r[str(b)]["same_output"][1]
                    for r in results.values() for b in arms[1:]) else 1  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
