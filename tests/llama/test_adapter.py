"""The llama.cpp adapter end to end: a controller daemon (loopback gRPC, the embedded Redis), the adapter serving its
HTTP API on a socket, and a llama-server per endpoint on the shipped pair. Greedy output through the adapter is what
the chosen endpoint gives when called directly, request by request, streamed or not; the controller's acceptance per
segment is llama-server's own count; a controller that does not answer fails no request; a bad configuration is
refused naming its field."""

from __future__ import annotations

import json
import socket
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from decoder.worker.config import ControllerLink
from specd.llama.adapter import make_app
from specd.llama.adapter_config import AdapterConfig, EndpointConfig, ServerLaunch, load_adapter_config
from specd.llama.adapter_run import adapter, served
from specd.llama.endpoints import Setting, route, setting
from specd.llama.ngram_simple import scored as lookup_scored
from specd.llama.server import tokens
from specd_api.errors import SpecdError
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.daemons import DEFAULT_POLICY, RPC_TIMEOUT, connected, running_daemon
from workloads import load_workload

WORKLOADS = Path(__file__).resolve().parents[2] / "workloads"

ENDPOINTS = ("none", "draft:4", "prompt_lookup:8")
FLOAT32_CACHE = ("-ctk", "f32", "-ctv", "f32")


def adapter_config(gguf_pair: dict[str, Path], binary: Path, address: str | None, **link: Any) -> AdapterConfig:
    return AdapterConfig(
        controller=ControllerLink(address=address, decide_deadline_ms=500.0, report_interval_seconds=0.1, **link),
        server=ServerLaunch(binary=binary, model=gguf_pair["target"], draft_model=gguf_pair["draft"],
                            args=FLOAT32_CACHE),
        endpoints=tuple(EndpointConfig(name=n) for n in ENDPOINTS),
    )  # fmt: skip


@pytest.fixture(scope="module")
def stack(embedded_redis_url, tmp_path_factory, server_binary, gguf_pair) -> Iterator[tuple[str, Any, dict]]:
    folder = tmp_path_factory.mktemp("adapter")
    with running_daemon(embedded_redis_url, folder, DEFAULT_POLICY.read_text()) as daemon, connected(daemon) as ch:
        config = adapter_config(gguf_pair, server_binary, daemon.address)
        with adapter(config, folder / "logs") as running_adapter, served(make_app(running_adapter)) as url:
            yield url, pb_grpc.ControllerStub(ch), running_adapter.urls


def prompts() -> list[tuple[str, str]]:
    out = []
    for workload in ("code", "extractive", "structured", "prose"):
        out += [(workload, r.prompt) for r in load_workload(WORKLOADS / f"{workload}.jsonl")[:3]]
    return out


def direct(url: str, ids: list[int], tokens: int) -> str:
    body = {"prompt": ids, "n_predict": tokens, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "stream": False,
            "return_tokens": True}  # fmt: skip
    answer = httpx.post(f"{url}/completion", json=body, timeout=120)
    answer.raise_for_status()
    return str(answer.json()["content"])


def test_greedy_output_is_the_chosen_endpoints_and_acceptance_is_llama_servers_count(stack) -> None:
    url, stub, urls = stack
    run = uuid.uuid4().hex[:6]
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # segment -> drafted, accepted, steps at draft:4
    sources: set[str] = set()
    # every endpoint by the caller's own choice first (what a benchmark does; the draft endpoint twice, so that each
    # segment holds the 3 requests a realised figure needs however the controller's plans go), then its plans
    chosen_by_caller = [{"drafter": s.drafter, "k": s.k} for s in urls] + [{"drafter": "draft", "k": 4}]
    passes: list[dict[str, Any] | None] = [*chosen_by_caller, None, None]
    for i, choice in enumerate(passes):
        for workload, prompt in prompts():
            segment = f"{workload}-{run}"
            body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "segment": segment}
            if choice is not None:
                body["speculation"] = choice
            stream = i == len(passes) - 1
            if stream:
                text, block = streamed(url, body)
            else:
                answer = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
                text, block = answer["choices"][0]["text"], answer["specd"]
            chosen = setting(block["endpoint"])
            assert chosen == route(block["drafter"], block["k"], tuple(urls)), block
            ids = tokens(urls[Setting("none", 0)], prompt)
            assert text == direct(urls[chosen], ids, 24), (segment, chosen, stream)
            sources.add(block["source"])
            if chosen.drafter == "draft":
                counts[segment][0] += block["drafted"]
                counts[segment][1] += block["accepted"]
                counts[segment][2] += block["tokens"] - 1 - block["accepted"]  # a step: its accepted and one more
    assert sources >= {"request"} and sources & {"controller", "table"}, sources
    time.sleep(1.0)  # the client's reports (every 0.1 s) and the controller's refresh
    for segment, (drafted, accepted, steps) in counts.items():
        stats = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=segment), timeout=RPC_TIMEOUT)
        draft = next(d for d in stats.drafters if d.drafter == "draft")
        by_k = next(b for b in draft.by_k if b.k == 4)
        assert by_k.proposed == pytest.approx(drafted, rel=0.02) and by_k.accepted == pytest.approx(accepted, rel=0.02)
        assert by_k.alpha == pytest.approx(accepted / drafted, abs=0.05)
        assert by_k.rounds == pytest.approx(steps, rel=0.02)
        assert draft.realised_requests >= 3  # what the plan realised, from the requests' totals
    assert len(counts) == 4, dict(counts)
    # prompt lookup, scored over the output of the controller's requests that did not run it
    scored = 0.0
    for workload in ("code", "extractive", "structured", "prose"):
        stats = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=f"{workload}-{run}"), timeout=RPC_TIMEOUT)
        lookup = [d for d in stats.drafters if d.drafter == "prompt_lookup"]
        scored += sum(p.offered for d in lookup for p in d.counterfactual_positions)
    assert scored > 0


def test_prompt_lookup_replayed_by_llamas_rule_drafts_and_accepts_what_llama_server_did(stack) -> None:
    """The adapter scores prompt lookup over other endpoints' output by llama.cpp's ngram-simple rule: replayed over
    the prompt lookup endpoint's own output, it drafts and accepts exactly what the server counted, request by
    request."""
    _, _, urls = stack
    drafted = 0
    for _, prompt in prompts():
        ids = tokens(urls[Setting("none", 0)], prompt)
        body = {"prompt": ids, "n_predict": 48, "temperature": 0.0, "top_k": 0, "stream": False, "return_tokens": True}
        answer = httpx.post(f"{urls[Setting('prompt_lookup', 8)]}/completion", json=body, timeout=120).json()
        generated, timings = answer["tokens"], answer["timings"]
        scored = lookup_scored(ids, generated, 8, 48)
        replayed = (sum(s.tally.num_drafted for s in scored), sum(s.tally.num_accepted for s in scored))
        assert replayed == (timings.get("draft_n", 0), timings.get("draft_n_accepted", 0)), prompt[:60]
        drafted += replayed[0]
    assert drafted > 0


def streamed(url: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    text, block = "", {}
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            text += chunk["choices"][0]["text"]
            block = chunk.get("specd", block)
    return text, block


def test_a_controller_that_does_not_answer_fails_no_request(tmp_path, server_binary, gguf_pair) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    config = adapter_config(gguf_pair, server_binary, dead)
    with adapter(config, tmp_path) as running_adapter, served(make_app(running_adapter)) as url:
        answer = httpx.post(f"{url}/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 8,
                                                            "temperature": 0}, timeout=60)  # fmt: skip
        assert answer.status_code == 200, answer.text
        block = answer.json()["specd"]
        assert block["endpoint"] == "none" and block["source"] == "local_default"
        assert running_adapter.client is not None and sum(running_adapter.client.stats().fallbacks.values()) >= 1


def test_a_bad_request_is_a_400_naming_the_field(stack) -> None:
    url, _, _ = stack
    for body, field in (({"prompt": "x", "max_tokens": 0}, "max_tokens"), ({"prompt": "x", "n": 2}, "n"),
                        ({"prompt": "x", "segment": "bad segment!"}, "segment")):  # fmt: skip
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == field


def test_a_bad_configuration_is_refused_naming_file_and_field(tmp_path) -> None:
    path = tmp_path / "adapter.yaml"
    for text, field in (
        ("endpoints: [{name: 'draft:4', url: 'http://127.0.0.1:1'}]", "one must be 'none'"),
        ("endpoints: [{name: none, url: 'http://x'}, {name: 'draft:zero', url: 'http://y'}]", "endpoint name"),
        ("endpoints: [{name: none}]", "server section"),
        ("server: {model: t.gguf}\nendpoints: [{name: none}, {name: 'draft:2'}]", "draft_model"),
        ("endpoints: [{name: none, url: 'ftp://x'}]", "http"),
    ):
        path.write_text(text)
        with pytest.raises(SpecdError) as refused:
            load_adapter_config(path)
        assert str(path) in str(refused.value) and field in str(refused.value), str(refused.value)


def test_routing_takes_the_largest_endpoint_k_within_the_plans() -> None:
    settings = tuple(setting(n) for n in ("none", "draft:2", "draft:4", "draft:8", "prompt_lookup:8"))
    assert route("draft", 5, settings) == Setting("draft", 4)
    assert route("draft", 8, settings) == Setting("draft", 8)
    assert route("draft", 1, settings) == Setting("draft", 2)  # below every endpoint: the smallest
    assert route("prompt_lookup", 3, settings) == Setting("prompt_lookup", 8)
    assert route("suffix", 4, settings) == Setting("none", 0)  # no endpoint for it
    assert route("draft", 0, settings) == Setting("none", 0)


def test_sigterm_stops_the_adapter_and_the_servers_it_started(tmp_path, server_binary, gguf_pair) -> None:
    import signal
    import subprocess
    import sys

    port_holder = socket.socket()
    port_holder.bind(("127.0.0.1", 0))
    port = port_holder.getsockname()[1]
    port_holder.close()
    config = tmp_path / "adapter.yaml"
    config.write_text(
        f"listen: 127.0.0.1:{port}\ncontroller: {{address: null}}\n"
        f"server: {{binary: {server_binary}, model: {gguf_pair['target']}}}\nendpoints: [{{name: none}}]\n"
    )
    log = tmp_path / "adapter.log"
    with log.open("w") as out:
        child = subprocess.Popen([sys.executable, "-m", "specd", "llama-adapter", "--config", str(config), "--log-dir",
                                  str(tmp_path)], stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert child.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.2)
        served = [line.split()[-3] for line in log.read_text().splitlines() if "endpoint none:" in line]
        assert served, log.read_text()
        child.send_signal(signal.SIGTERM)
        assert child.wait(30) == 0, log.read_text()[-2000:]
        with pytest.raises(httpx.HTTPError):  # the llama-server the adapter started is gone with it
            httpx.get(f"{served[0]}/health", timeout=2)
    finally:
        if child.poll() is None:
            child.kill()


def test_the_adapters_start_up_calibration_gives_the_controller_llama_cpps_costs(stack) -> None:
    _, stub, _ = stack

    def greedy_costs() -> pb.BucketCosts | None:
        costs = stub.GetCosts(pb.GetCostsRequest(), timeout=RPC_TIMEOUT)
        return next((b for b in costs.buckets if b.batch_bucket == 1 and b.mode == "greedy" and b.measured), None)

    deadline = time.monotonic() + 10
    while (greedy := greedy_costs()) is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert greedy is not None and greedy.step_seconds > 0
    assert len(greedy.verify_rounds) >= 9, (list(greedy.verify_rounds), list(greedy.verify_cost))
    assert all(greedy.verify_rounds[n] > 0 for n in range(9)), list(greedy.verify_rounds)  # plain, and 1..8 drafts
    # a pass over more tokens costs more: v(1) above a plain step, v(8) above v(1)
    assert 1.03 < greedy.verify_cost[1] < greedy.verify_cost[8], (list(greedy.verify_cost), list(greedy.verify_rounds))
    assert 0 < greedy.cost_ratio["draft"] < 1 and greedy.cost_ratio["prompt_lookup"] == 0.0


def test_a_pass_of_n_plus_one_new_tokens_is_a_round_that_verifies_n_drafts() -> None:
    from specd.llama.calibration import SEQUENCES, calibration_sequences

    verify = {w: [w / 1000.0] * SEQUENCES for w in range(1, 6)}  # a pass of w tokens: w ms
    sequences = calibration_sequences(verify, [0.0003] * SEQUENCES, max_k=4, lookup=True)
    assert len(sequences) == SEQUENCES
    rounds = [r for s in sequences for r in s]
    by = {(r.drafter, r.num_drafted): r.verify_seconds for r in rounds}
    assert by[("none", 0)] == 0.001  # a plain step: one new token
    assert all(by[("prompt_lookup", n)] == (n + 1) / 1000.0 for n in range(1, 5))
    assert by[("draft", 1)] == 0.002 and all(r.draft_seconds == 0.0003 for r in rounds if r.drafter == "draft")
    assert sorted({r.k for r in rounds if r.drafter == "prompt_lookup"}) == [1, 2, 3, 4]
    assert calibration_sequences(verify, [], max_k=4, lookup=False)[0][0].drafter == "none"
    assert not any(r.drafter != "none" for s in calibration_sequences(verify, [], 4, False) for r in s)
