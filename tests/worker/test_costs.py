"""Costs the controller can trust: known costs injected into the real worker come back out of the controller.

The worker's engine runs a tiny pair whose passes are made slow on purpose, by a known amount that dwarfs their
own compute: a target pass verifying n drafts sleeps STEP x V[n], a draft pass sleeps DRAFT. The real
WorkerService (scheduler, engine, per-sequence cost shares, client library) reports over real gRPC to a real
controller daemon, which stores in real Redis (the embedded server) and learns c and v(n) from what it stored.
Its learned figures must match the injected ones, at batch 1 and at batch 2, where each sequence is charged half
of every pass it shares.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from controller.server import ControllerDaemon
from decoder.runners import KVPool
from decoder.sampling import SamplingParams
from decoder.worker.config import WorkerConfig
from decoder.worker.service import RequestSpec, Speculation, WorkerService
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.daemons import running_daemon

STEP = 0.030  # seconds of one injected target step
V = (1.0, 1.6, 1.9, 1.5, 1.25)  # injected v(n) for n = 0..4 drafts: not a line, not monotonic
DRAFT = 0.012  # seconds of one injected draft pass: c = 0.4
TOLERANCE = 0.15  # the bar: learned within ±15% of the truth


@pytest.fixture
def slow_passes(monkeypatch) -> Iterator[dict[tuple[str, int, int], list[float]]]:
    """Injects the sleeps; yields each pass's own compute, (model, width, sequences) -> seconds: what a pass costs
    is the sleep plus that (on a slow CPU, float64 passes of 2 sequences take ~4.7 ms beside the 30 ms step, and the
    learned v(n) are then 6 % closer to 1 than the sleeps alone: right, as that is what the passes cost)."""
    real = KVPool.forward_many
    compute: dict[tuple[str, int, int], list[float]] = {}

    def forward_many(self, rows, logits_to_keep=0, trees=None, tap=None):
        start = time.perf_counter()
        out = real(self, rows, logits_to_keep, trees, tap)
        took = time.perf_counter() - start
        width = max(int(ids.shape[0]) for _, ids in rows)
        if "draft" in Path(self.lm.name).name:
            compute.setdefault(("draft", 0, len(rows)), []).append(took)
            time.sleep(DRAFT)
        elif width <= len(V):  # a verification pass (a longer one is a prefill: left as it is)
            compute.setdefault(("target", width, len(rows)), []).append(took)
            time.sleep(STEP * V[width - 1])
        return out

    monkeypatch.setattr(KVPool, "forward_many", forward_many)
    yield compute


@pytest.fixture
def controller(tmp_path: Path, embedded_redis_url: str) -> Iterator[ControllerDaemon]:
    """A daemon (tests/daemons.py) with an empty policy and a half-life of 1e9 s."""
    with running_daemon(embedded_redis_url, tmp_path, "{}\n", learning={"half_life_seconds": 1e9}) as daemon:
        yield daemon


@pytest.fixture
def worker(tiny_pair, controller, slow_passes) -> Iterator[WorkerService]:
    config = WorkerConfig(
        target=tiny_pair.target, draft=tiny_pair.draft, device="cpu", dtype="float64", threads=1, max_batch=4,
        segment_classifier="none", telemetry={"exporter": "none"},
        warm_up=False,  # no start-up calibration: every timing the controller learns from is a served round's
        controller={"address": controller.address, "report_interval_seconds": 0.1, "decide_deadline_ms": 1000},
    )  # fmt: skip
    service = WorkerService(config)
    service.startup()
    yield service
    service.shutdown()


def run(service: WorkerService, requests: list[Speculation], tokens: int = 40) -> None:
    """Decode ``requests`` at the same time (batched when more than one), each with its own drafter and K."""

    async def one(chosen: Speculation, seed: int) -> None:
        spec = RequestSpec(
            prompt_text=None, prompt_ids=[5 + seed, 9, 3, 7, 2, 8], max_new_tokens=tokens, params=SamplingParams(),
            stop_strings=(), segment="costs", speculation=chosen,
        )  # fmt: skip
        async for event in service.run_request(spec):
            assert event.kind != "error", event

    async def together() -> None:
        await asyncio.gather(*(one(r, i) for i, r in enumerate(requests)))

    asyncio.run(together())


def learned(controller: ControllerDaemon, buckets: set[int]) -> dict[int, pb.BucketCosts]:
    stub = pb_grpc.ControllerStub(grpc.insecure_channel(controller.address))
    deadline = time.monotonic() + 10
    while True:
        model = {b.batch_bucket: b for b in stub.GetCosts(pb.GetCostsRequest(), timeout=5).buckets}
        if buckets <= set(model) and all(len(model[b].verify_rounds) >= len(V) for b in buckets):
            return model
        assert time.monotonic() < deadline, f"costs never arrived: {model}"
        time.sleep(0.1)


def near(got: float, want: float) -> bool:
    return abs(got - want) <= TOLERANCE * want


def test_injected_costs_are_recovered_at_batch_one_and_two(worker, controller, slow_passes):
    # batch 1: plain decoding and the draft at every K up to 4, one request at a time
    for k in range(5):
        run(worker, [Speculation("draft" if k else "none", k)])
    # batch 2: two sequences share every pass (same K, so each pass has one width)
    for k in range(5):
        run(worker, [Speculation("draft" if k else "none", k)] * 2)
    costs = learned(controller, {1, 2})
    for bucket, share in ((1, 1.0), (2, 0.5)):
        c = costs[bucket]
        got = (c.step_seconds, c.cost_ratio["draft"], *c.verify_cost[: len(V)])

        def pass_of(model: str, width: int, injected: float, sequences: int = bucket) -> float:
            """A pass's cost: the injected sleep plus the pass's own compute, its median here."""
            return injected + statistics.median(slow_passes[(model, width, sequences)])

        step = pass_of("target", 1, STEP)
        want = (
            step * share,
            pass_of("draft", 0, DRAFT) / step,
            *(pass_of("target", n + 1, STEP * v) / step for n, v in enumerate(V)),
        )
        shown = [(f"{x[0] * 1e3:.2f} ms", round(x[1], 3), [round(v, 2) for v in x[2:]]) for x in (got, want)]
        print(f"bucket {bucket}: learned {shown[0]}; injected plus each pass's compute {shown[1]}")
        assert all(near(g, w) for g, w in zip(got, want, strict=True)), (bucket, got, want)


def test_reports_of_a_request_that_opted_out_are_not_counted(worker, controller):
    run(worker, [Speculation("none", 0, report=False)])
    run(worker, [Speculation("none", 0)])
    stub = pb_grpc.ControllerStub(grpc.insecure_channel(controller.address))
    deadline = time.monotonic() + 10
    while (stats := stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment="costs"), timeout=5)).rounds == 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(0.5)  # room for a second report, had there been one
    stats = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment="costs"), timeout=5)
    # one request of 40 tokens, the first from its prefill, then one per round: the other was not reported
    assert stats.rounds == pytest.approx(39)
