"""The controller steering llama.cpp's server, in the user's frame: the shipped workloads through the adapter
(``specd llama-adapter``), adaptive against every endpoint alone on the same prompts, and the adapter's cost against
calling the plain server directly (A/A).

One controller (``specd controller``, a fresh key prefix in the Redis at ``--redis-url``) and one adapter
(``specd llama-adapter``, the shipped configuration's settings) with an endpoint per setting (none, draft:2, draft:4,
draft:8, prompt_lookup:8); the plain server is started here and named to the adapter by its URL, so that the A/A
pair calls the same server. Each prompt runs, in a rotated order, as:

- ``adaptive``: the controller's plan per request, on segments it has never seen (its learning is in the figure);
- each endpoint alone: the request names its own ``speculation`` and is not reported (every static setting a rival);
- the A/A pair: through the adapter on a segment the policy forces off (tokenize, Decide, route, report: the adapter's
  whole path) against the same text sent to the plain server's ``/completion`` directly; then the same pairs again
  with ``--aa-settle`` seconds of quiet before each request, so that neither pays for the controller's handling of
  earlier reports on these two cores (a controller on its own host costs the engine's host nothing).

Every request is timed at the client, prompt included. Ratios are paired per prompt: the geometric mean of a
rival's seconds over adaptive's, with a 90 % bootstrap interval over prompts. ``--passes`` repeats the prompts;
the figures are given over all passes and over the last (the controller has then seen each segment's earlier
requests). Greedy outputs are compared with the plain endpoint's, and the controller's acceptance per segment with
llama-server's counts.

    python benchmarks/llama_adaptive.py [--per-workload 4] [--tokens 48] [--passes 3] [--policy PATH] [--json PATH]

``--policy`` is the controller's policy (the shipped ``policies/default.yaml`` unless given); the A/A rule is added
to its segment rules.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ENDPOINTS = ("none", "draft:2", "draft:4", "draft:8", "prompt_lookup:8")
WORKLOADS = ("code", "extractive", "structured", "toolcall", "prose", "adversarial")
AA_RULE = '  - match: "aa-*"             # the A/A segments: Decide answers none\n    force: none\n'
BOOTSTRAP = 2_000


def geometric_ratio(pairs: list[tuple[float, float]], seed: int = 0) -> dict[str, float]:
    """The geometric mean of a / b over the pairs, with a 90 % bootstrap interval (resampling the pairs)."""
    logs = [math.log(a / b) for a, b in pairs if a > 0 and b > 0]
    if not logs:
        return {"ratio": float("nan"), "low": float("nan"), "high": float("nan"), "n": 0}
    r = random.Random(seed)
    means = sorted(sum(r.choices(logs, k=len(logs))) / len(logs) for _ in range(BOOTSTRAP))
    return {"ratio": math.exp(sum(logs) / len(logs)), "low": math.exp(means[int(0.05 * BOOTSTRAP)]),
            "high": math.exp(means[int(0.95 * BOOTSTRAP) - 1]), "n": len(logs)}  # fmt: skip


@contextmanager
def process(command: list[str], log: Path, ready: Callable[[], bool], seconds: float = 180.0) -> Iterator[None]:
    """``command`` running (its output in ``log``) from when ``ready()`` holds until the block ends."""
    with log.open("w") as out:
        child = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + seconds
        while not ready():
            if child.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{' '.join(command[:4])} did not start: {log.read_text()[-2000:]}")
            time.sleep(0.2)
        yield
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(30)
        except subprocess.TimeoutExpired:
            child.kill()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(
    per_workload: int, tokens: int, passes: int, redis_url: str, settle: float, policy_path: Path
) -> dict[str, Any]:
    """The controller and the adapter in their own processes, as deployed (a process sharing the adapter's
    interpreter would cost it the GIL): ``specd controller`` and ``specd llama-adapter``."""
    import grpc
    import httpx
    import yaml

    from specd.llama.build import build
    from specd.llama.gguf_export import export
    from specd.llama.server import running
    from specd_api.v1 import controller_pb2 as pb
    from specd_api.v1 import controller_pb2_grpc as pb_grpc
    from workloads import load_workload

    folder = Path(tempfile.mkdtemp(prefix="specd-llama-adaptive-"))
    pair = {n: export(ROOT / "models" / "reference" / n, folder / f"{n}.gguf") for n in ("target", "draft")}
    policy = folder / "policy.yaml"
    policy.write_text(policy_path.read_text() + AA_RULE)
    controller_address, adapter_port = f"127.0.0.1:{free_port()}", free_port()
    controller = yaml.safe_load((ROOT / "configs" / "controller.yaml").read_text())
    controller.update(listen=controller_address, redis_url=redis_url, policy_path=str(policy),
                      state_dir=str(folder / "state"))  # fmt: skip
    controller["learning"]["prefix"] = f"llama{uuid.uuid4().hex[:8]}"
    (folder / "controller.yaml").write_text(yaml.safe_dump(controller))
    adapter = yaml.safe_load((ROOT / "configs" / "llama-adapter.yaml").read_text())
    adapter.update(listen=f"127.0.0.1:{adapter_port}", tokenizer=str(ROOT / "models" / "reference" / "target"),
                   endpoints=[{"name": n} for n in ENDPOINTS if n != "none"])  # fmt: skip
    adapter["controller"]["address"] = controller_address
    adapter["server"].update(binary=str(build()), model=str(pair["target"]), draft_model=str(pair["draft"]))
    server = adapter["server"]
    server["args"] = [
        *server["args"],
        "--no-cache-prompt",
    ]  # every request pays for its prompt, whichever arm ran first
    url = f"http://127.0.0.1:{adapter_port}"
    specd = [sys.executable, "-m", "specd"]
    channel = grpc.insecure_channel(controller_address)
    stub = pb_grpc.ControllerStub(channel)

    def answers(call: Callable[[], object]) -> Callable[[], bool]:
        def ready() -> bool:
            try:
                call()
                return True
            except Exception:
                return False

        return ready

    run = uuid.uuid4().hex[:6]
    prompts = [
        (w, r.prompt) for w in WORKLOADS for r in load_workload(ROOT / "workloads" / f"{w}.jsonl")[:per_workload]
    ]
    seconds: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))  # arm -> prompt -> per pass
    texts: dict[str, dict[int, str]] = defaultdict(dict)
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # adaptive's segment@endpoint -> drafted, accepted
    routed: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    # one client for both arms, without Nagle: a request's head and body leave at once
    nodelay = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    http = httpx.Client(timeout=300, transport=nodelay)
    controller_up = answers(lambda: stub.GetPolicy(pb.GetPolicyRequest(), timeout=1))
    adapter_up = answers(lambda: http.get(f"{url}/health", timeout=1).raise_for_status())
    with (
        running(Path(server["binary"]), pair["target"], tuple(server["args"]), log=folder / "plain.log",
                threads=server["threads"], context=server["context"]) as plain,
        process([*specd, "controller", "--config", str(folder / "controller.yaml")], folder / "controller.log",
                controller_up),
        ExitStack() as stack,
    ):  # fmt: skip
        adapter["endpoints"].insert(0, {"name": "none", "url": plain})
        (folder / "adapter.yaml").write_text(yaml.safe_dump(adapter))
        stack.enter_context(process([*specd, "llama-adapter", "--config", str(folder / "adapter.yaml"), "--log-dir",
                                     str(folder / "logs")], folder / "adapter.log", adapter_up))  # fmt: skip

        def through(prompt: str, segment: str, speculation: dict[str, Any] | None) -> tuple[float, dict[str, Any]]:
            body: dict[str, Any] = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "segment": segment}
            if speculation is not None:
                body["speculation"] = speculation
            start = time.perf_counter()
            answer = http.post(f"{url}/v1/completions", json=body)
            elapsed = time.perf_counter() - start
            answer.raise_for_status()
            return elapsed, answer.json()

        def direct(prompt: str) -> tuple[float, str]:
            start = time.perf_counter()
            answer = http.post(f"{plain}/completion", json={"prompt": prompt, "n_predict": tokens, "temperature": 0})
            elapsed = time.perf_counter() - start
            answer.raise_for_status()
            return elapsed, str(answer.json()["content"])

        arms = ["adaptive", *ENDPOINTS, "aa-adapter", "aa-direct"]
        for p in range(passes):
            for i, (workload, prompt) in enumerate(prompts):
                shift = (i + p) % len(arms)
                for arm in arms[shift:] + arms[:shift]:
                    if arm == "aa-direct":
                        elapsed, text = direct(prompt)
                    else:
                        if arm == "adaptive":
                            segment, choice = f"{workload}-{run}", None
                        elif arm == "aa-adapter":
                            segment, choice = f"aa-{workload}-{run}", None
                        else:
                            name = arm.split(":")
                            k = int(name[1]) if len(name) > 1 else 0
                            segment, choice = f"static-{run}", {"drafter": name[0], "k": k, "report": False}
                        elapsed, answer = through(prompt, segment, choice)
                        text = answer["choices"][0]["text"]
                        if arm == "adaptive":
                            block = answer["specd"]
                            routed[workload][block["endpoint"]] += 1
                            if block["endpoint"].startswith("draft"):
                                c = counts[f"{segment}@{block['endpoint']}"]
                                c[0] += block["drafted"]
                                c[1] += block["accepted"]
                    seconds[arm][i].append(elapsed)
                    texts[arm].setdefault(i, text)
        settled: list[tuple[float, float]] = []  # the A/A pair again, each request on a machine left quiet
        for p in range(passes if settle > 0 else 0):
            for i, (workload, prompt) in enumerate(prompts):
                pair: dict[str, float] = {}
                for arm in ("adapter", "direct") if (i + p) % 2 else ("direct", "adapter"):
                    time.sleep(settle)  # the controller's work for earlier reports (sent every 0.5 s) is done
                    if arm == "direct":
                        pair[arm] = direct(prompt)[0]
                    else:
                        pair[arm] = through(prompt, f"aa-{workload}-{run}", None)[0]
                settled.append((pair["adapter"], pair["direct"]))
        time.sleep(2.5)  # the last reports and a refresh
        alpha_gap = 0.0
        held: dict[str, dict[str, dict[str, float]]] = {}  # workload -> drafter -> what the controller holds
        for workload in WORKLOADS:
            stats = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=f"{workload}-{run}"), timeout=10)
            held[workload] = {
                d.drafter: {"realised": round(d.realised_speedup, 3), "requests": round(d.realised_requests, 1),
                            "model": round(d.model_speedup, 3), "expected": round(d.expected_speedup, 3),
                            "lower": round(d.lower_bound, 3), "calibration": round(d.calibration, 3)}
                for d in stats.drafters
            }  # fmt: skip
        for key, (drafted, accepted) in counts.items():
            segment, endpoint = key.split("@")
            stats = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=segment), timeout=10)
            k = int(endpoint.split(":")[1])
            learned = next((b for d in stats.drafters if d.drafter == "draft" for b in d.by_k if b.k == k), None)
            if learned is not None and drafted:
                alpha_gap = max(alpha_gap, abs(learned.alpha - accepted / drafted))
    channel.close()
    result = summarise(prompts, seconds, texts, routed, alpha_gap, passes)
    result["aa_settled_adapter_over_direct"] = geometric_ratio(settled)
    result["learned"] = held
    return result


def summarise(prompts: list[tuple[str, str]], seconds: dict[str, dict[int, list[float]]],
              texts: dict[str, dict[int, str]], routed: dict[str, dict[str, int]], alpha_gap: float,
              passes: int) -> dict[str, Any]:  # fmt: skip
    def pairs(rival: str, workload: str | None, last: bool) -> list[tuple[float, float]]:
        out = []
        for i, (w, _) in enumerate(prompts):
            if workload is None or w == workload:
                take = slice(passes - 1, passes) if last else slice(0, passes)
                out += list(zip(seconds[rival][i][take], seconds["adaptive"][i][take], strict=True))
        return out

    frames: dict[str, Any] = {}
    for frame, last in (("all_passes", False), ("last_pass", True)):
        table: dict[str, Any] = {}
        for workload in (*WORKLOADS, None):
            table[workload or "all"] = {e: geometric_ratio(pairs(e, workload, last)) for e in ENDPOINTS}
        frames[frame] = table
    overall = frames["all_passes"]["all"]
    best_single = max(ENDPOINTS, key=lambda e: 1 / overall[e]["ratio"])  # the endpoint fastest over every workload
    # the routing ceiling: each workload on its own fastest endpoint (chosen on these very times, so optimistic)
    per_workload = {w: max(ENDPOINTS, key=lambda e, w=w: 1 / frames["all_passes"][w][e]["ratio"]) for w in WORKLOADS}
    oracle = [
        (a, b)
        for i, (w, _) in enumerate(prompts)
        for a, b in zip(seconds[best_single][i], seconds[per_workload[w]][i], strict=True)
    ]
    aa = [(seconds["aa-adapter"][i][p], seconds["aa-direct"][i][p]) for i in range(len(prompts)) for p in range(passes)]
    same = sum(texts["adaptive"][i] == texts["none"][i] for i in range(len(prompts)))
    return {
        "prompts": len(prompts), "passes": passes, "frames": frames, "best_single_endpoint": best_single,
        "adaptive_vs_best_single": overall[best_single], "adaptive_vs_plain": overall["none"],
        "best_endpoint_per_workload": per_workload, "routing_ceiling_vs_best_single": geometric_ratio(oracle),
        "aa_adapter_over_direct": geometric_ratio(aa), "adaptive_same_as_plain": same,
        "routed": {w: dict(r) for w, r in routed.items()}, "alpha_max_gap": alpha_gap,
        "seconds": {arm: [seconds[arm][i] for i in range(len(prompts))] for arm in seconds},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-workload", type=int, default=4, metavar="N", help="prompts per shipped workload")
    parser.add_argument("--tokens", type=int, default=48, metavar="N", help="tokens generated per request")
    parser.add_argument("--passes", type=int, default=3, metavar="N", help="times each prompt runs in each arm")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--aa-settle", type=float, default=0.6, metavar="S",
                        help="the settled A/A pairs: seconds of quiet before each request (0: none)")  # fmt: skip
    parser.add_argument("--policy", type=Path, default=ROOT / "policies" / "default.yaml", metavar="PATH",
                        help="the controller's policy, its segment rules last (the A/A rule is added)")  # fmt: skip
    parser.add_argument("--json", type=Path, metavar="PATH")
    args = parser.parse_args()
    result = measure(args.per_workload, args.tokens, args.passes, args.redis_url, args.aa_settle, args.policy)
    for frame in ("all_passes", "last_pass"):
        print(f"\nadaptive's speedup over each endpoint alone ({frame.replace('_', ' ')}): rival seconds / adaptive "
              "seconds, geometric mean [90% bootstrap]")  # fmt: skip
        print(f"{'workload':<12} " + " ".join(f"{e:>20}" for e in ENDPOINTS))
        for workload, row in result["frames"][frame].items():
            cells = " ".join(f"{r['ratio']:>6.2f} [{r['low']:.2f},{r['high']:.2f}]" for r in row.values())
            print(f"{workload:<12} {cells}")
    best, aa = result["best_single_endpoint"], result["aa_adapter_over_direct"]
    vs = result["adaptive_vs_best_single"]
    print(f"\nbest single endpoint over all workloads: {best}; adaptive over it {vs['ratio']:.3f}x "
          f"[{vs['low']:.3f}, {vs['high']:.3f}]")  # fmt: skip
    ceiling = result["routing_ceiling_vs_best_single"]
    fastest = json.dumps(result["best_endpoint_per_workload"])
    print(f"routing's ceiling (each workload on its own fastest endpoint, {fastest}) "
          f"over {best}: {ceiling['ratio']:.3f}x [{ceiling['low']:.3f}, {ceiling['high']:.3f}]")  # fmt: skip
    print(f"A/A: adapter (Decide: none) over the plain server directly {aa['ratio']:.3f} [{aa['low']:.3f}, "
          f"{aa['high']:.3f}] ({aa['n']} pairs, in the rotation)")  # fmt: skip
    quiet = result["aa_settled_adapter_over_direct"]
    print(f"A/A settled ({args.aa_settle} s of quiet before each request): {quiet['ratio']:.3f} [{quiet['low']:.3f}, "
          f"{quiet['high']:.3f}] ({quiet['n']} pairs)")  # fmt: skip
    print(f"adaptive output equal to plain on {result['adaptive_same_as_plain']}/{result['prompts']} prompts; "
          f"controller alpha vs llama-server's counts: max gap {result['alpha_max_gap']:.4f}")  # fmt: skip
    print(f"adaptive's endpoints per workload: {json.dumps(result['routed'])}")
    for workload, drafters in result["learned"].items():
        print(f"controller, {workload}: {json.dumps(drafters)}")
    print(json.dumps({"adaptive_vs_best_single": vs["ratio"], "adaptive_vs_plain": result["adaptive_vs_plain"]["ratio"],
                      "routing_ceiling_vs_best_single": ceiling["ratio"],
                      "aa_overhead": aa["ratio"] - 1.0, "aa_settled_overhead": quiet["ratio"] - 1.0}))  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
