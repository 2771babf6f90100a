"""A/A: the cost of being controlled. A controlled worker whose every decision is ``none`` against an uncontrolled
worker, on the same prompts, side by side in one run (specd/bench/aa.py holds the method).

Starts the controller (embedded Redis, fresh state), a worker that asks it (the policy forces no speculation for its
aa/* segments, so it runs the whole control path: Decide or the pushed tables, reports, counterfactual scoring) and a
worker with no controller, both on the reference pair; sends every prompt to both (concurrency 1, the order
alternating); prints the paired median of controlled / uncontrolled decode rate and whole-request rate, each with its
bootstrap 95 % interval.

    python benchmarks/control_cost.py [--prompts-per-segment 8] [--max-new-tokens 128] [--json FILE]

Goal: >= 0.98 (decode, paired median), the interval's lower end >= 0.96.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

if __package__ in (None, ""):  # run as a file: the repository root is not on the path, benchmarks/ is
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specd.bench.aa import CONTROLLED, UNCONTROLLED, aa_figures, run_pairs, summary, write_pairs
from specd.bench.run import interleaved, load_prompts
from specd.demo.configs import (
    REFERENCE,
    ROOT,
    DemoPaths,
    controller_config,
    uncontrolled_worker_config,
    with_off_rule,
    worker_config,
    write_config,
)
from specd.launch import Service, start

WARM_UP_PROMPTS = 6  # per worker, before anything is timed: first requests pay one-off costs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts-per-segment", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policy", type=Path, default=ROOT / "policies" / "default.yaml")
    parser.add_argument("--out", type=Path, default=None, help="run folder (default: a temporary one)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    workloads = tuple(sorted((ROOT / "workloads").glob("*.jsonl")))
    prompts = interleaved(load_prompts(workloads, args.prompts_per_segment, args.seed))
    with tempfile.TemporaryDirectory(prefix="specd-aa-") as scratch:
        paths = DemoPaths((args.out or Path(scratch)).resolve())
        paths.logs.mkdir(parents=True, exist_ok=True)
        services: dict[str, Service] = {}
        try:
            urls = start_services(paths, args.policy, services)
            with httpx.Client(timeout=600) as client:
                run_pairs(client, urls, prompts[:WARM_UP_PROMPTS], args.max_new_tokens, time.perf_counter)
                started = time.monotonic()
                pairs = run_pairs(client, urls, prompts, args.max_new_tokens, time.perf_counter)
                seconds = time.monotonic() - started
        finally:
            for name in (CONTROLLED, UNCONTROLLED, "controller"):
                if name in services:
                    services[name].stop()
        figures = aa_figures(pairs)
        result = {**summary(pairs, figures), "seconds": round(seconds, 1), "prompts": len(prompts)}
        for kind, f in figures.items():
            print(f"A/A {kind}: controlled (every decision none) / uncontrolled {f.median:.3f} "
                  f"[{f.interval[0]:.3f}, {f.interval[1]:.3f}] over {f.prompts} prompts")  # fmt: skip
        if not result["all_none"]:
            print("warning: the controlled worker speculated on some request: not an A/A")
        if args.out is not None:
            write_pairs(paths.run / "pairs.json", pairs)
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def start_services(paths: DemoPaths, policy_file: Path, services: dict[str, Service]) -> dict[str, str]:
    policy = with_off_rule(yaml.safe_load(policy_file.read_text()) or {})
    policy_path = write_config(paths.config("policy"), policy, "A/A: aa/* segments never speculate")
    config = controller_config(paths, policy_path)
    config["telemetry"] = {"exporter": "none"}
    controller_file = write_config(paths.config("controller"), config, "A/A: the controller")
    services["controller"] = start("controller", ["controller", "--config", str(controller_file)],
                                   paths.log("controller"), timeout_seconds=180)  # fmt: skip
    urls = {}
    for name in (CONTROLLED, UNCONTROLLED):
        worker = worker_config(paths, name, REFERENCE / "target", REFERENCE / "draft")
        worker["telemetry"] = {"exporter": "none"}
        if name == UNCONTROLLED:
            worker = uncontrolled_worker_config(worker)
        path = write_config(paths.config(name), worker, f"A/A: the {name} worker")
        link = services["controller"].address if name == CONTROLLED else "none"
        args = ["worker", "--config", str(path), "--controller", link]
        services[name] = start(name, args, paths.log(name), timeout_seconds=300)
        urls[name] = services[name].url
    return urls


if __name__ == "__main__":
    sys.exit(main())
