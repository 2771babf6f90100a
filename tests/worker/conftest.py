"""The worker over its real path: `specd worker` processes on real sockets (specd.launch.start), serving a tiny
random Llama pair written once per session, configured by YAML files written like a user would.

Worker processes cost a few seconds each, so the ones several modules share are session-scoped:
``draft_worker`` (draft model, K=3) and ``lookup_worker`` (prompt lookup, K=4, no segment classifier).
Every worker's log is checked for tracebacks when it stops: the worker must never crash on a request.

Without HTTP: ``in_process`` starts a ``WorkerService`` in the test's process, and ``done_info`` runs one request
through it. ``Worker.connect`` opens a raw socket to a worker process, for clients no HTTP library would imitate.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from decoder.sampling import SamplingParams
from decoder.tiny import save_tiny_pair
from decoder.worker.config import WorkerConfig
from decoder.worker.service import RequestSpec, WorkerService
from specd.launch import Service, start

MODEL = "tiny-worker-test"

# What every test worker shares; each test module overrides what it exercises.
BASE_CONFIG: dict[str, Any] = {
    "listen": "127.0.0.1:0",
    "model_name": MODEL,
    "device": "cpu",
    "dtype": "float64",  # exactness tests compare token for token: no float rounding flips an argmax
    "threads": 1,  # tiny models gain nothing from threads; the machine's cores are shared
    "max_batch": 8,
    "max_tokens_limit": 500,
    "default_max_tokens": 16,
    "controller": {"address": None},
    "telemetry": {"exporter": "none"},
}


@dataclass(frozen=True)
class TinyPair:
    target: Path
    draft: Path  # tiny-pair's own draft: a different random model, accepts (almost) nothing
    near_draft: Path  # the target with noise on its weights: accepts some drafts, rejects others

    @property
    def tokenizer_path(self) -> Path:
        return self.target


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory) -> TinyPair:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root = tmp_path_factory.mktemp("tiny-pair")
    target, draft = save_tiny_pair(root)
    model = AutoModelForCausalLM.from_pretrained(target)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * 0.1 * param.std())
    near = root / "near-draft"
    model.save_pretrained(near)
    AutoTokenizer.from_pretrained(target).save_pretrained(near)
    return TinyPair(target, draft, near)


def write_config(folder: Path, name: str, pair: TinyPair, **overrides: Any) -> Path:
    """A worker YAML file: BASE_CONFIG, the pair (near draft by default), then ``overrides`` (``controller``
    merges into the base's controller section)."""
    config = {**BASE_CONFIG, "target": str(pair.target), "draft": str(pair.near_draft)}
    controller = {**BASE_CONFIG["controller"], **overrides.pop("controller", {})}
    config.update(overrides, controller=controller)
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@dataclass
class Worker:
    """A running `specd worker` and the ways tests talk to it."""

    service: Service
    log: Path

    @property
    def url(self) -> str:
        return self.service.url

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=timeout)

    def connect(self, timeout: float = 10.0) -> socket.socket:
        """A raw TCP connection to the worker (the caller closes it)."""
        host, port = self.service.address.rsplit(":", 1)
        return socket.create_connection((host, int(port)), timeout=timeout)

    def post(self, path: str, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        with self.client() as client:
            return client.post(path, json=body, **kwargs)

    def complete(self, prompt: str, **body: Any) -> dict[str, Any]:
        """A non-streaming completion that must succeed."""
        response = self.post("/v1/completions", {"prompt": prompt, **body})
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    def stream(self, path: str, body: dict[str, Any]) -> list[Any]:
        """A streaming request's data payloads, decoded ("[DONE]" stays a string)."""
        with self.client() as client, client.stream("POST", path, json={**body, "stream": True}) as response:
            assert response.status_code == 200, response.read().decode()
            assert response.headers["content-type"].startswith("text/event-stream")
            return list(sse_payloads(response.iter_lines()))

    def metrics(self) -> Metrics:
        with self.client() as client:
            response = client.get("/metrics")
        assert response.status_code == 200
        return Metrics.parse(response.text)

    def health(self) -> dict[str, Any]:
        with self.client() as client:
            body: dict[str, Any] = client.get("/health").json()
        return body

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not within {timeout:g} s (health: {self.health()})")
            time.sleep(0.02)

    def wait_idle(self) -> None:
        self.wait_for(lambda: (h := self.health())["queue_depth"] == 0 and h["batch_size"] == 0, "worker idle")


def sse_payloads(lines: Iterator[str]) -> Iterator[Any]:
    """The ``data:`` payloads of a server-sent event stream, JSON-decoded except the final "[DONE]"."""
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        data = line[len("data: ") :]
        yield data if data == "[DONE]" else json.loads(data)


@dataclass(frozen=True)
class Metrics:
    """One /metrics scrape: every sample by name and labels."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]

    @classmethod
    def parse(cls, text: str) -> Metrics:
        samples = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return cls(samples)

    def names(self) -> set[str]:
        return {name for name, _ in self.samples}

    def total(self, name: str, **labels: str) -> float:
        """The sum over the samples named ``name`` whose labels include ``labels``."""
        return sum(
            value
            for (sample, sample_labels), value in self.samples.items()
            if sample == name and set(labels.items()) <= set(sample_labels)
        )

    def steps_above(self, batch_size: int) -> float:
        """Decode steps that ran more than ``batch_size`` sequences (specd_step_batch_size buckets)."""
        everything = self.total("specd_step_batch_size_count")
        return everything - self.total("specd_step_batch_size_bucket", le=f"{float(batch_size)}")


class WorkerLauncher:
    """Starts workers and stops them all at the end, checking each log for tracebacks."""

    def __init__(self, folder: Path, pair: TinyPair) -> None:
        self.folder, self.pair = folder, pair
        self.workers: list[Worker] = []

    def config(self, name: str, **overrides: Any) -> Path:
        return write_config(self.folder, name, self.pair, **overrides)

    def start(self, name: str, **overrides: Any) -> Worker:
        path = self.config(name, **overrides)
        log = self.folder / f"{name}.log"
        service = start(f"worker-{name}", ["worker", "--config", str(path)], log_path=log, timeout_seconds=120)
        atexit.register(service.kill)  # should the session end without its teardown (no-op once stopped)
        worker = Worker(service, log)
        self.workers.append(worker)
        return worker

    def stop(self, worker: Worker) -> int | None:
        status = worker.service.stop(timeout_seconds=20)
        assert_clean_log(worker)
        return status

    def stop_all(self) -> None:
        """Stop every worker (all drain at once), then check every log."""
        for worker in self.workers:
            if worker.service.alive():
                worker.service.process.send_signal(signal.SIGTERM)
        for worker in self.workers:
            worker.service.stop(timeout_seconds=20)
        for worker in self.workers:
            assert_clean_log(worker)


def assert_clean_log(worker: Worker) -> None:
    time.sleep(0.1)  # the output pump writes the last lines
    text = worker.log.read_text()
    assert "Traceback" not in text, f"{worker.service.name} logged a traceback:\n{text[-4000:]}"


@pytest.fixture(scope="session")
def launcher(tmp_path_factory, tiny_pair) -> Iterator[WorkerLauncher]:
    launcher = WorkerLauncher(tmp_path_factory.mktemp("workers"), tiny_pair)
    yield launcher
    launcher.stop_all()


@pytest.fixture(scope="session")
def draft_worker(launcher) -> Worker:
    """Draft model (the near draft), K=3, batches of up to 8, heuristic segments."""
    return launcher.start(
        "draft", segment_classifier="heuristic",
        controller={"default_drafter": "draft", "default_k": 3},
    )  # fmt: skip


@pytest.fixture(scope="session")
def lookup_worker(launcher) -> Worker:
    """Prompt lookup, K=4, batches of up to 8, no segment classifier (every unnamed request is "tenant-a")."""
    return launcher.start(
        "lookup", segment_classifier="none", default_segment="tenant-a",
        controller={"default_drafter": "prompt_lookup", "default_k": 4},
    )  # fmt: skip


class Reference:
    """The target, in-process (float64, transformers' own generate): what greedy output must be."""

    def __init__(self, path: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path).double().eval()
        self._cache: dict[tuple[str, int], list[int]] = {}

    def greedy(self, prompt: str, max_tokens: int) -> list[int]:
        """The greedy continuation's token ids, EOS (id 0) included when it comes."""
        key = (prompt, max_tokens)
        if key not in self._cache:
            ids = torch.tensor([self.tokenizer(prompt)["input_ids"]])
            with torch.no_grad():
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False,
                    eos_token_id=0, pad_token_id=0,
                )  # fmt: skip
            self._cache[key] = [int(t) for t in out[0, ids.shape[1] :]]
        return self._cache[key]


@pytest.fixture(scope="session")
def reference(tiny_pair) -> Reference:
    return Reference(tiny_pair.target)


# --- a WorkerService in the test's process -------------------------------------------------------------------


def service_config(pair: TinyPair, **overrides: Any) -> WorkerConfig:
    """A worker on ``pair``'s target alone (float64, one thread, batches of 2, no segment classifier, no
    telemetry), then ``overrides``."""
    fields: dict[str, Any] = {
        "target": pair.target, "draft": None, "device": "cpu", "dtype": "float64", "threads": 1, "max_batch": 2,
        "segment_classifier": "none", "telemetry": {"exporter": "none"},
    }  # fmt: skip
    fields.update(overrides)
    return WorkerConfig(**fields)


@contextmanager
def in_process(config: WorkerConfig) -> Iterator[WorkerService]:
    """The worker's service (no HTTP server), started; shut down on the way out."""
    service = WorkerService(config)
    service.startup()
    try:
        yield service
    finally:
        service.shutdown()


def done_info(
    service: WorkerService, segment: str, max_new_tokens: int, prompt_ids: tuple[int, ...] = (5, 9, 3, 7)
) -> dict[str, Any]:
    """One greedy request through ``service``: its ``done`` event's ``specd`` statistics (an error event fails)."""
    spec = RequestSpec(prompt_text=None, prompt_ids=list(prompt_ids), max_new_tokens=max_new_tokens,
                       params=SamplingParams(), stop_strings=(), segment=segment)  # fmt: skip

    async def run() -> dict[str, Any]:
        async for event in service.run_request(spec):
            assert event.kind != "error", event
            if event.kind == "done":
                return event.specd
        raise AssertionError("no done event")

    return asyncio.run(run())
