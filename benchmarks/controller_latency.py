"""Controller benchmark: decision latency in-process and over loopback gRPC, and telemetry ingestion rate.

Starts `specd controller` as its own process (embedded Redis unless --redis-url), teaches it 50 segments,
then measures, in one run:
  in-process   Controller.decide() in this process, no gRPC   (target p99 <= 100 µs)
  grpc         Decide over loopback, one client, sequential   (target p99 <= 2 ms)
  grpc-conc    Decide from 2 client processes x 4 threads                  (target >= 2,000 decisions/s)
  ingestion    ReportRounds with 100 aggregates x 50 rounds   (target >= 20,000 rounds/s)

    python benchmarks/controller_latency.py [--redis-url redis://127.0.0.1:6379/0] [--seconds 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import grpc

from controller.config import ControllerConfig, load_config
from controller.decision.decide import Request
from controller.server import ControllerDaemon
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parent.parent
SEGMENTS = [f"tenant-{i}" for i in range(50)]


def aggregate(segment: str, rng: random.Random, rounds: int = 50, k: int = 4) -> pb.RoundsAggregate:
    """``rounds`` rounds of a draft at K with acceptance 0.7 per position, as a worker would report."""
    proposed = [rounds] * k
    verified, accepted = [0] * k, [0] * k
    total = 0
    for _ in range(rounds):
        a = 0
        while a < k and rng.random() < 0.7:
            a += 1
        total += a
        for i in range(k):
            verified[i] += i <= a
            accepted[i] += i < a
    return pb.RoundsAggregate(
        segment=segment, drafter="draft", k=k, rounds=rounds, num_drafted=rounds * k,
        num_accepted=total, proposed_per_position=proposed, verified_per_position=verified,
        accepted_per_position=accepted, tokens_emitted=total + rounds, draft_seconds=0.001 * rounds * k,
        verify_seconds=0.012 * rounds, batch_size=1, temperature=0.0, prompt_tokens=200, self_repetition=0.2,
        rounds_by_drafted=[0] * k + [rounds], verify_seconds_by_drafted=[0.0] * k + [0.012 * rounds],  # all drafted K
    )  # fmt: skip


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def describe(name: str, samples: list[float], seconds: float) -> str:
    us = [s * 1e6 for s in samples]
    return (
        f"{name:<12} n={len(us):>7}  p50 {percentile(us, 0.5):>8.1f} µs  p99 {percentile(us, 0.99):>8.1f} µs  "
        f"max {max(us):>9.1f} µs  {len(us) / seconds:>9.0f}/s"
    )


def decide_request(rng: random.Random) -> pb.DecideRequest:
    return pb.DecideRequest(
        segment=rng.choice(SEGMENTS), batch_size=rng.choice((1, 2, 4)), drafters=["draft", "prompt_lookup"],
        sampling=pb.SamplingParams(temperature=0.0), prompt_tokens=200, max_new_tokens=128,
        prompt_features=pb.PromptFeatures(self_repetition=0.2),
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", default=None, help="default: an embedded server")
    parser.add_argument("--seconds", type=float, default=3.0, help="duration of each timed phase")
    args = parser.parse_args()

    state = Path(tempfile.mkdtemp(prefix="specd-bench-"))
    prefix = f"bench{uuid.uuid4().hex[:8]}"
    config_path = state / "controller.yaml"
    config_path.write_text(
        f"listen: 127.0.0.1:{free_port()}\n"
        f"redis_url: {args.redis_url or 'null'}\n"
        f"policy_path: {REPO / 'policies' / 'default.yaml'}\n"
        f"state_dir: {state / 'state'}\n"
        f"learning: {{prefix: {prefix}, refresh_seconds: 1.0}}\n"
    )
    server = subprocess.Popen(
        [sys.executable, "-m", "specd", "controller", "--config", str(config_path), "--log-level", "WARNING"],
        cwd=REPO,
    )
    address = load_config(config_path).listen
    try:
        grpc.channel_ready_future(grpc.insecure_channel(address)).result(timeout=60)
        run(address, args.seconds, args.redis_url, state)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


def time_decides(stub: pb_grpc.ControllerStub, msgs: list[pb.DecideRequest], seconds: float) -> list[float]:
    """Latency of each Decide sent back to back for ``seconds``, cycling through ``msgs``."""
    latencies = []
    stop = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < stop:
        start = time.perf_counter()
        stub.Decide(msgs[i % len(msgs)], timeout=1.0)
        latencies.append(time.perf_counter() - start)
        i += 1
    return latencies


def client_process(address: str, seconds: float, seed: int, threads: int = 4) -> list[float]:
    """Decide as fast as possible from ``threads`` threads for ``seconds``; the latencies."""
    latencies: list[float] = []
    lock = threading.Lock()

    def client(thread_seed: int) -> None:
        stub = pb_grpc.ControllerStub(grpc.insecure_channel(address))
        rng = random.Random(thread_seed)
        msgs = [decide_request(rng) for _ in range(100)]
        stub.Decide(msgs[0], timeout=5.0)  # connect before the clock starts
        mine = time_decides(stub, msgs, seconds)
        with lock:
            latencies.extend(mine)

    pool = [threading.Thread(target=client, args=(seed * 100 + t,)) for t in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return latencies


def run(address: str, seconds: float, redis_url: str | None, state: Path) -> None:
    rng = random.Random(0)
    stub = pb_grpc.ControllerStub(grpc.insecure_channel(address))
    # Learned state: 50 segments with 10 reports each.
    for i, segment in enumerate(SEGMENTS):
        for j in range(10):
            stub.ReportRounds(pb.ReportRoundsRequest(report_id=f"warm-{i}-{j}", aggregates=[aggregate(segment, rng)]))
    time.sleep(1.5)  # the daemon's refresh picks them up
    print(f"controller process on {address}, {len(SEGMENTS)} segments learned, {os.cpu_count()} CPUs")

    # 1. In-process decisions: a second controller in this process over the same Redis data.
    local = ControllerDaemon(
        ControllerConfig(
            listen="127.0.0.1:0",
            redis_url=redis_url or f"unix://{state / 'state' / 'redis' / 'valkey.sock'}",
            policy_path=REPO / "policies" / "default.yaml",
            state_dir=state / "local",
            learning=load_config(state / "controller.yaml").learning,
        )
    )
    local.startup()
    try:
        assert local.controller is not None
        controller = local.controller
        requests = [
            Request(rng.choice(SEGMENTS), rng.choice((1, 2, 4)), ("draft", "prompt_lookup"), 128, 200, 0.0, 0.2)
            for _ in range(1000)
        ]
        samples: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for req in requests[:100]:
                start = time.perf_counter()
                controller.decide(req)
                samples.append(time.perf_counter() - start)
            requests.append(requests.pop(0))
        print(describe("in-process", samples, seconds))
    finally:
        local.shutdown()

    # 2. Decide over loopback gRPC, sequential.
    msgs = [decide_request(rng) for _ in range(200)]
    for m in msgs[:50]:
        stub.Decide(m)  # warm the channel
    print(describe("grpc", time_decides(stub, msgs, seconds), seconds))

    # 3. Throughput with concurrent clients: 2 processes x 4 threads, so the clients' own GIL is not the limit.
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        parts = pool.starmap(client_process, [(address, seconds, seed) for seed in (1, 2)])
    concurrent = [latency for part in parts for latency in part]
    print(describe("grpc-conc", concurrent, seconds))

    # 4. Ingestion: batched reports (100 aggregates of 50 rounds = 5,000 rounds per call).
    batch = [aggregate(rng.choice(SEGMENTS), rng) for _ in range(100)]
    rounds_per_call = sum(a.rounds for a in batch)
    samples = []
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        start = time.perf_counter()
        response = stub.ReportRounds(pb.ReportRoundsRequest(report_id=f"bench-{n}", aggregates=batch), timeout=5.0)
        samples.append(time.perf_counter() - start)
        assert response.rounds_accepted == rounds_per_call and not response.journaled
        n += 1
    rate = n * rounds_per_call / sum(samples)
    print(describe("ingestion", samples, sum(samples)).rsplit("  ", 1)[0] + f"  {rate:>9.0f} rounds/s")
    print("targets: in-process p99 <= 100 µs, grpc p99 <= 2,000 µs, grpc-conc >= 2,000/s, ingestion >= 20,000 rounds/s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
