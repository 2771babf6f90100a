"""llama.cpp's server on the shipped pair, one endpoint per speculation setting, side by side on the shipped prompts:
how often each speculative endpoint's greedy output differs from the plain endpoint's (llama.cpp's exactness in
float arithmetic, measured), the acceptance it reports (``timings.draft_n`` / ``draft_n_accepted``), and its decode
speed against plain, paired per prompt (median ratio and its 10-90% spread over prompts).

Needs the server (``make llama-server``); exports the pair to GGUF itself.

    python benchmarks/llama_endpoints.py [--per-workload 3] [--tokens 48] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENDPOINTS = ("none", "draft:2", "draft:4", "draft:8", "prompt_lookup:8")  # specd.llama.endpoints names them
FLOAT32_CACHE = ("-ctk", "f32", "-ctv", "f32")


def complete(url: str, ids: list[int], tokens: int) -> dict[str, Any]:
    import httpx

    body = {"prompt": ids, "n_predict": tokens, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
            "return_tokens": True}  # fmt: skip
    answer = httpx.post(f"{url}/completion", json=body, timeout=300)
    answer.raise_for_status()
    return dict(answer.json())


def spread(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    at = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return statistics.median(ordered), at(0.1), at(0.9)


def measure(per_workload: int, tokens: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from specd.llama.build import built
    from specd.llama.endpoints import setting
    from specd.llama.gguf_export import export
    from specd.llama.server import running
    from workloads import load_all

    binary = built()
    if binary is None:
        raise SystemExit("llama-server is not built: make llama-server")
    reference = ROOT / "models" / "reference"
    tokenizer = AutoTokenizer.from_pretrained(reference / "target")
    by_workload = load_all(ROOT / "workloads")
    prompts = [(name, tokenizer(p.prompt)["input_ids"][-192:]) for name in sorted(by_workload)
               for p in by_workload[name][:per_workload]]  # fmt: skip
    folder = Path(tempfile.mkdtemp(prefix="specd-llama-bench-"))
    target, draft = (export(reference / n, folder / f"{n}.gguf") for n in ("target", "draft"))
    results: dict[str, list[dict[str, Any]]] = {}
    with ExitStack() as stack:
        urls = {
            name: stack.enter_context(
                running(
                    binary,
                    target,
                    (*FLOAT32_CACHE, *setting(name).server_args(draft)),
                    log=folder / f"{name.replace(':', '-')}.log",
                )
            )
            for name in ENDPOINTS
        }
        for name in ENDPOINTS:  # one warm-up request each
            complete(urls[name], prompts[0][1], 8)
        for _, ids in prompts:
            for name in ENDPOINTS:  # interleaved: the machine's drift lands on every endpoint alike
                results.setdefault(name, []).append(complete(urls[name], ids, tokens))
    plain = results["none"]
    summary: dict[str, Any] = {}
    for name, rows in results.items():
        same = sum(r["tokens"] == p["tokens"] for r, p in zip(rows, plain, strict=True))
        drafted = sum(r["timings"].get("draft_n", 0) for r in rows)
        accepted = sum(r["timings"].get("draft_n_accepted", 0) for r in rows)
        ratios = [p["timings"]["predicted_ms"] / r["timings"]["predicted_ms"] for r, p in zip(rows, plain, strict=True)
                  if r["timings"]["predicted_n"] == p["timings"]["predicted_n"]]  # fmt: skip
        median, low, high = spread(ratios)
        summary[name] = {
            "same_as_plain": same, "prompts": len(rows), "drafted": drafted, "accepted": accepted,
            "acceptance": round(accepted / drafted, 3) if drafted else None,
            "speedup_vs_plain": round(median, 3), "speedup_p10": round(low, 3), "speedup_p90": round(high, 3),
        }  # fmt: skip
    ratios_by: dict[str, dict[str, list[float]]] = {}
    for name, answers in results.items():
        for (workload, _), answer, base in zip(prompts, answers, plain, strict=True):
            if answer["timings"]["predicted_n"] == base["timings"]["predicted_n"]:
                ratio = base["timings"]["predicted_ms"] / answer["timings"]["predicted_ms"]
                ratios_by.setdefault(workload, {}).setdefault(name, []).append(ratio)
    medians = {w: {n: round(statistics.median(v), 3) for n, v in by.items()} for w, by in ratios_by.items()}
    return {"tokens": tokens, "prompts": len(prompts), "endpoints": summary, "by_workload": medians}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-workload", type=int, default=3, metavar="N", help="prompts per shipped workload")
    parser.add_argument("--tokens", type=int, default=48, metavar="N", help="tokens generated per request")
    parser.add_argument("--json", type=Path, metavar="PATH")
    args = parser.parse_args()
    result = measure(args.per_workload, args.tokens)
    print(f"{'endpoint':<16} {'same as plain':>14} {'acceptance':>11} {'speedup (p10-p90)':>22}")
    for name, row in result["endpoints"].items():
        acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        print(f"{name:<16} {row['same_as_plain']:>6}/{row['prompts']:<7} {acceptance:>11} "
              f"{row['speedup_vs_plain']:>8.2f}x ({row['speedup_p10']:.2f}-{row['speedup_p90']:.2f})")  # fmt: skip
    names = list(result["endpoints"])
    print(f"\nmedian speedup over plain per workload ({args.per_workload} prompts each)")
    print(f"{'workload':<12} " + " ".join(f"{n:>15}" for n in names) + "   best")
    for workload, row in result["by_workload"].items():
        best = max(row, key=row.get)
        print(f"{workload:<12} " + " ".join(f"{row.get(n, float('nan')):>15.2f}" for n in names) + f"   {best}")
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
