"""Decisions pushed to workers (WatchDecisions) against one Decide call per request, measured side by side in one run.

Starts `specd controller` as its own process (embedded Redis unless --redis-url), teaches it 50 segments, then:

  1. one worker     decisions/s of one ControllerClient deciding back to back from one thread: locally from the
                    pushed tables, then with a Decide call each (the client library's full path, spans off);
  2. 64 workers     --workers simulated workers (ControllerClients in --processes processes), each deciding
                    --rate times a second for --seconds, first with Decide per request, then from the tables:
                    the controller process's CPU (user + system, from /proc), the decisions made, how many were
                    local, fallbacks, and the decision latency the workers saw.

    python benchmarks/decision_stream.py [--workers 64] [--rate 20] [--seconds 10] [--json FILE]

Reports go to the controller in neither phase: this measures the decision path alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

if __package__ in (None, ""):  # run as a file: the repository root is not on the path, benchmarks/ is
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.controller_latency import SEGMENTS, aggregate, percentile
from benchmarks.faults import Controller
from specd_api.request_features import RequestFeatures
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from specd_client import ClientConfig, ControllerClient

REPO = Path(__file__).resolve().parent.parent
DRAFTERS = ("draft", "prompt_lookup")
DEADLINE_MS = 100.0  # generous: the benchmark measures the controller's load, not this machine's scheduling
TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def make_client(address: str, name: str, watch: bool) -> ControllerClient:
    config = ClientConfig(address=address, worker_id=name, decide_deadline_ms=DEADLINE_MS,
                          watch_decisions=DRAFTERS if watch else ())  # fmt: skip
    client = ControllerClient(config)
    client.start()
    client.wait_until_ready(30.0)
    if watch:
        deadline = time.monotonic() + 30.0
        while client.table_segments < len(SEGMENTS):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the tables hold {client.table_segments} of {len(SEGMENTS)} segments")
            time.sleep(0.05)
    return client


def decide(client: ControllerClient, rng: random.Random) -> str:
    plan = client.decide(RequestFeatures(
        segment=rng.choice(SEGMENTS), batch_size=rng.choice((1, 2, 4)), drafters=DRAFTERS, temperature=0.0, top_p=1.0,
        top_k=0, prompt_tokens=200, max_new_tokens=128, self_repetition=0.2,
    ))  # fmt: skip
    return plan.origin.source


def one_worker(address: str, watch: bool, seconds: float) -> dict[str, float]:
    """Back-to-back decisions from one thread: the rate, the latency, the share answered locally."""
    client = make_client(address, f"one-{watch}", watch)
    rng = random.Random(1)
    latencies, local = [], 0
    try:
        end = time.perf_counter() + seconds
        while (start := time.perf_counter()) < end:
            local += decide(client, rng) == "table"
            latencies.append(time.perf_counter() - start)
    finally:
        client.close(flush_timeout_s=0.5)
    return {
        "decisions_per_second": len(latencies) / seconds,
        "p50_us": percentile(latencies, 0.5) * 1e6,
        "p99_us": percentile(latencies, 0.99) * 1e6,
        "local_share": local / len(latencies),
    }


def simulated_workers(
    address: str, watch: bool, workers: int, rate: float, start_at: float, seconds: float, seed: int
) -> dict[str, Any]:
    """``workers`` clients in this process, each on a thread deciding ``rate`` times a second from ``start_at``
    (wall clock) for ``seconds``."""
    logging.getLogger("specd").setLevel(logging.ERROR)  # fallbacks are counted, not logged per client
    clients = [make_client(address, f"sim-{seed}-{i}", watch) for i in range(workers)]
    latencies: list[float] = []
    counts = {"decisions": 0, "local": 0}
    lock = threading.Lock()

    def run(i: int, client: ControllerClient) -> None:
        rng = random.Random(seed * 1000 + i)
        mine, local = [], 0
        time.sleep(max(start_at - time.time(), 0.0) + rng.random() / rate)  # spread the workers over a period
        n = 0
        begin = time.perf_counter()
        while n < seconds * rate:
            due = begin + n / rate
            time.sleep(max(due - time.perf_counter(), 0.0))
            t = time.perf_counter()
            local += decide(client, rng) == "table"
            mine.append(time.perf_counter() - t)
            n += 1
        with lock:
            latencies.extend(mine)
            counts["decisions"] += len(mine)
            counts["local"] += local

    threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(clients)]
    for t in threads:
        t.start()
    time.sleep(max(start_at - time.time(), 0.0))
    cpu_before = time.process_time()  # this process's CPU while its workers decide (all its threads)
    for t in threads:
        t.join()
    cpu = time.process_time() - cpu_before
    fallbacks = sum(sum(c.stats().fallbacks.values()) for c in clients)
    for c in clients:
        c.close(flush_timeout_s=0.2)
    return {**counts, "fallbacks": fallbacks, "latencies": latencies, "worker_cpu_seconds": cpu}


def fleet(address: str, pid: int, watch: bool, workers: int, processes: int, rate: float, seconds: float) -> dict:
    """The controller's CPU while ``workers`` simulated workers decide at ``rate`` each."""
    start_at = time.time() + 8.0 + workers * 0.05  # every client connected (and holding its tables) by then
    per = [workers // processes + (i < workers % processes) for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pending = pool.starmap_async(
            simulated_workers, [(address, watch, n, rate, start_at, seconds, seed) for seed, n in enumerate(per)]
        )
        time.sleep(max(start_at - time.time(), 0.0))
        cpu_start, wall_start = cpu_seconds(pid), time.perf_counter()
        time.sleep(seconds)
        cpu_end, wall = cpu_seconds(pid), time.perf_counter() - wall_start
        parts = pending.get(timeout=seconds + 120)
    latencies = [x for p in parts for x in p["latencies"]]
    decisions = sum(p["decisions"] for p in parts)
    return {
        "controller_cpu_percent": 100 * (cpu_end - cpu_start) / wall,
        "decisions_per_second": decisions / seconds,
        "local_share": sum(p["local"] for p in parts) / max(decisions, 1),
        "fallbacks": sum(p["fallbacks"] for p in parts),
        "p50_us": percentile(latencies, 0.5) * 1e6,
        "p99_us": percentile(latencies, 0.99) * 1e6,
        "worker_cpu_percent": 100 * sum(p["worker_cpu_seconds"] for p in parts) / seconds,
    }


def teach(address: str) -> None:
    rng = random.Random(0)
    stub = pb_grpc.ControllerStub(grpc.insecure_channel(address))
    for i, segment in enumerate(SEGMENTS):
        for j in range(10):
            stub.ReportRounds(pb.ReportRoundsRequest(report_id=f"warm-{i}-{j}", aggregates=[aggregate(segment, rng)]))
    time.sleep(2.5)  # the daemon's refresh picks them up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=None, help="default: an embedded server")
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--processes", type=int, default=4, help="processes the simulated workers run in")
    parser.add_argument("--rate", type=float, default=20.0, help="decisions per second per simulated worker")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="specd-bench-stream-"))
    controller = Controller(state, args.redis_url or "null", refresh_seconds=1.0,
                            settings=f"max_workers: 16\nmax_watchers: {args.workers + 8}\n")  # fmt: skip
    try:
        controller.start()
        teach(controller.address)
        results = run(controller.address, controller.pid, args)
    finally:
        controller.stop()
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def run(address: str, pid: int, args: argparse.Namespace) -> dict:
    print(f"controller pid {pid} on {address}: {len(SEGMENTS)} segments learned, {os.cpu_count()} CPUs")
    idle_start = cpu_seconds(pid)
    time.sleep(3.0)
    idle = 100 * (cpu_seconds(pid) - idle_start) / 3.0
    single = {"decide": one_worker(address, False, 3.0), "stream": one_worker(address, True, 3.0)}
    print("\n1. one worker, back to back (ControllerClient.decide):")
    for mode, r in single.items():
        print(f"   {mode:<7} {r['decisions_per_second']:>9.0f} decisions/s  p50 {r['p50_us']:>7.1f} µs  "
              f"p99 {r['p99_us']:>7.1f} µs  local {r['local_share']:.0%}")  # fmt: skip
    ratio = single["stream"]["decisions_per_second"] / single["decide"]["decisions_per_second"]
    print(f"   local / Decide: {ratio:.0f}x")

    print(f"\n2. {args.workers} simulated workers x {args.rate:g} decisions/s for {args.seconds:g} s "
          f"(controller idle: {idle:.1f}% CPU):")  # fmt: skip
    fleet_results = {}
    for mode, watch in (("decide", False), ("stream", True)):
        r = fleet(address, pid, watch, args.workers, args.processes, args.rate, args.seconds)
        fleet_results[mode] = r
        print(f"   {mode:<7} controller {r['controller_cpu_percent']:>6.1f}% CPU  {r['decisions_per_second']:>6.0f} "
              f"decisions/s  local {r['local_share']:.0%}  fallbacks {r['fallbacks']}  p50 {r['p50_us']:>7.1f} µs  "
              f"p99 {r['p99_us']:>8.1f} µs  workers {r['worker_cpu_percent']:.0f}% CPU")  # fmt: skip
    cpu = {mode: r["controller_cpu_percent"] for mode, r in fleet_results.items()}
    saved = cpu["decide"] / max(cpu["stream"], 0.1)
    print(f"   controller CPU, Decide per request / stream: {saved:.1f}x")
    sys.stdout.flush()
    return {"workers": args.workers, "rate_per_worker": args.rate, "seconds": args.seconds,
            "controller_idle_cpu_percent": idle, "one_worker": single, "fleet": fleet_results}  # fmt: skip


if __name__ == "__main__":
    main()
