"""Talking to the running services as a user would: completions over HTTP, /metrics scraped and parsed, and the
``specd`` CLI run as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import ROOT
from workloads import Prompt, load_all

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Reply:
    """One finished HTTP request: status, body, and when it was sent and answered (monotonic seconds)."""

    prompt: Prompt
    status: int
    body: dict[str, Any]
    sent: float
    answered: float

    @property
    def segment(self) -> str:
        return self.prompt.segment

    @property
    def specd(self) -> dict[str, Any]:
        return dict(self.body.get("specd") or {})


def mixed_workload(per_segment: int) -> list[Prompt]:
    """The first ``per_segment`` prompts of every workload file, interleaved (one of each segment in turn)."""
    by_segment = load_all(ROOT / "workloads")
    columns = [prompts[:per_segment] for _, prompts in sorted(by_segment.items())]
    return [column[i] for i in range(per_segment) for column in columns if i < len(column)]


def complete(http: httpx.Client, prompt: Prompt, max_tokens: int, headers: Mapping[str, str] | None = None) -> Reply:
    """POST /v1/completions, greedy (so the run is deterministic), with the prompt's segment in the body."""
    body = {"prompt": prompt.prompt, "max_tokens": max_tokens, "temperature": 0.0, "segment": prompt.segment}
    sent = time.monotonic()
    response = http.post("/v1/completions", json=body, headers=dict(headers or {}))
    return Reply(prompt, response.status_code, response.json(), sent, time.monotonic())


def in_threads(work: Callable[[T], R], items: Iterable[T], threads: int) -> list[R]:
    """``work`` over ``items`` from ``threads`` threads; results in the order of ``items``."""
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(work, items))


class Metrics:
    """One scrape of a Prometheus endpoint: sample values by name and labels."""

    def __init__(self, text: str) -> None:
        self.samples: list[tuple[str, dict[str, str], float]] = [
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(text)
            for s in family.samples
        ]

    @classmethod
    def scrape(cls, http: httpx.Client) -> Metrics:
        response = http.get("/metrics")
        response.raise_for_status()
        return cls(response.text)

    def by_labels(self, name: str, *keys: str) -> dict[tuple[str, ...], float]:
        """``name``'s samples keyed by the values of ``keys`` (summed over the other labels)."""
        out: dict[tuple[str, ...], float] = {}
        for sample_name, labels, value in self.samples:
            if sample_name == name:
                key = tuple(labels.get(k, "") for k in keys)
                out[key] = out.get(key, 0.0) + value
        return out

    def total(self, name: str) -> float:
        return sum(value for sample_name, _, value in self.samples if sample_name == name)

    def histogram(self, name: str) -> list[tuple[float, float]]:
        """(upper bound, cumulative count) of a histogram's buckets, +Inf last."""
        buckets = [(float(labels["le"]), value) for n, labels, value in self.samples if n == f"{name}_bucket"]
        return sorted(buckets)


def specd_cli(*args: str, timeout_s: float = 60.0) -> Any:
    """``specd ARGS`` in a subprocess; its stdout parsed as JSON."""
    done = subprocess.run(
        [sys.executable, "-m", "specd", *args], capture_output=True, text=True, cwd=ROOT, timeout=timeout_s
    )
    assert done.returncode == 0, f"specd {' '.join(args)} exited {done.returncode}:\n{done.stderr}"
    return json.loads(done.stdout)


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, every_s: float = 0.2) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:g} s")
        time.sleep(every_s)


def controller_counts(address: str) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(rounds, proposed, accepted) per (segment, drafter) as the controller has them, over all K."""
    import grpc

    from specd_api.v1 import controller_pb2 as pb
    from specd_api.v1 import controller_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        segments = pb_grpc.ControllerStub(channel).ListSegments(pb.ListSegmentsRequest(), timeout=10).segments
    out: dict[tuple[str, str], tuple[float, float, float]] = {}
    for s in segments:
        for d in s.drafters:
            if d.by_k:
                out[(s.segment, d.drafter)] = (
                    sum(k.rounds for k in d.by_k),
                    sum(k.proposed for k in d.by_k),
                    sum(k.accepted for k in d.by_k),
                )
    return out


def worker_counts(metrics: Metrics) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(rounds, proposed, accepted) per (segment, drafter) from the worker's own counters."""
    rounds = metrics.by_labels("specd_rounds_total", "segment", "drafter")
    proposed = metrics.by_labels("specd_draft_tokens_total", "segment", "drafter")
    accepted = metrics.by_labels("specd_accepted_tokens_total", "segment", "drafter")
    return {key: (n, proposed.get(key, 0.0), accepted.get(key, 0.0)) for key, n in rounds.items()}


def same_counts(
    controller: Mapping[tuple[str, str], tuple[float, ...]], worker: Mapping[tuple[str, str], tuple[float, ...]]
) -> bool:
    """Equal as counts: the controller's are decayed floats, within 1e-6 of the worker's integers."""
    return controller.keys() == worker.keys() and all(
        abs(c - w) < 1e-6 for key in worker for c, w in zip(controller[key], worker[key], strict=True)
    )


def wait_for_reports(controller_address: str, http: httpx.Client, timeout_s: float = 30.0) -> Metrics:
    """Wait until the controller counts every round the worker counted; the worker's metrics at that point."""
    seen: list[tuple[Metrics, dict, dict]] = []

    def arrived() -> bool:
        metrics = Metrics.scrape(http)
        seen[:] = [(metrics, controller_counts(controller_address), worker_counts(metrics))]
        return same_counts(seen[0][1], seen[0][2])

    try:
        wait_until(arrived, timeout_s, "the controller has every round the worker counted")
    except TimeoutError as e:
        _, controller, worker = seen[0]
        differ = {key: (controller.get(key), worker.get(key)) for key in controller.keys() | worker.keys()
                  if controller.get(key) != worker.get(key)}  # fmt: skip
        raise AssertionError(f"{e}; (rounds, proposed, accepted) controller vs worker: {differ}") from None
    return seen[0][0]
