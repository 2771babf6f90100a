"""The whole system as it runs in production: embedded Redis, the controller daemon and the decode worker as
real processes, a mixed workload over HTTP, and what `specd alpha --json` says afterwards.

Two things must hold. The controller's statistics are the worker's own counters, exactly (every round reported
once, none lost or doubled on the way through the client's buffer, the gRPC report, the Lua ingest and the
decayed read). And decisions follow the data: a segment the controller knows nothing about is decided from the
prior (the draft model), and once its reports come in, every acceptance estimate it is decided with is the
posterior of exactly those rounds, computed here independently. Which plan that data favours is left open: on
these few 24-token requests the arms are within each other's noise (on the adversarial prompts the draft's α at
position 0 is about 0.65-0.77 and the chain's about 0.5), so a test that named the winner would fail on a machine
where another plan comes out on top. The tests' policy
forces ``adversarial*`` off by rule (tests/e2e/conftest.py), so that the rule is shown on the adversarial prompts,
and the learning on the same prompts under a segment name no rule covers.
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from typing import TypeVar

import httpx

from controller.decision.policy import Policy, parse_policy
from specd_api.speedup import MODEL_DRAFTERS
from tests.e2e.conftest import POLICY, Stack
from tests.e2e.traffic import (
    ROOT,
    Metrics,
    Reply,
    complete,
    controller_counts,
    in_threads,
    mixed_workload,
    specd_cli,
    wait_for_reports,
    worker_counts,
)
from workloads import Prompt

PER_SEGMENT = 6
MAX_TOKENS = 24
THREADS = 3
K = TypeVar("K")
UNRULED = "random-text"  # the adversarial prompts under a name that no policy rule covers
UNSEEN = "never-seen"  # a segment no request names: where a segment with no rounds starts


def workload() -> tuple[list[Prompt], list[Prompt], list[Prompt]]:
    """One prompt of each workload segment, the adversarial prompts relabelled ``UNRULED``, and the rest."""
    prompts = mixed_workload(PER_SEGMENT)  # segments interleaved
    unruled = [replace(p, segment=UNRULED) for p in prompts if p.segment == "adversarial"]
    one_each = len(prompts) // PER_SEGMENT
    return prompts[:one_each], unruled, prompts[one_each:]


def spread(into: list[Prompt], extra: list[Prompt]) -> list[Prompt]:
    """``extra`` spread evenly through ``into``."""
    placed = [(i / len(into), p) for i, p in enumerate(into)] + [(i / len(extra), p) for i, p in enumerate(extra)]
    return [p for _, p in sorted(placed, key=lambda item: item[0])]


def alpha_json_counts(summary: list[dict]) -> dict[tuple[str, str], tuple[float, float, float]]:
    """(rounds, proposed, accepted) per (segment, drafter) over all K, from `specd alpha --json`."""
    out = {}
    for segment in summary:
        for drafter in segment["drafters"]:
            by_k = drafter["by_k"]
            if by_k:
                out[(segment["segment"], drafter["drafter"])] = (
                    sum(k["rounds"] for k in by_k),
                    sum(k["proposed"] for k in by_k),
                    sum(k["accepted"] for k in by_k),
                )
    return out


def alpha_json_positions(summary: list[dict]) -> dict[tuple[str, str, int], tuple[float, float]]:
    """(proposed, accepted) per (segment, drafter, draft position), positions that were proposed only."""
    return {
        (segment["segment"], drafter["drafter"], position["position"]): (position["proposed"], position["accepted"])
        for segment in summary
        for drafter in segment["drafters"]
        for position in drafter["positions"]
        if position["proposed"]
    }


def worker_positions(metrics: Metrics) -> dict[tuple[str, str, int], tuple[float, float]]:
    proposed = metrics.by_labels("specd_position_proposed_total", "segment", "drafter", "position")
    accepted = metrics.by_labels("specd_position_accepted_total", "segment", "drafter", "position")
    return {(s, d, int(i)): (n, accepted.get((s, d, i), 0.0)) for (s, d, i), n in proposed.items() if n}


def as_counts(table: dict[K, tuple[float, ...]]) -> dict[K, tuple[int, ...]]:
    """Decayed counts as the integers they must be (the half-life leaves them within 1e-6 of one)."""
    values = [x for row in table.values() for x in row]
    assert all(abs(x - round(x)) < 1e-6 for x in values), table
    return {key: tuple(round(x) for x in row) for key, row in table.items()}


def evidence(drafter: dict) -> dict[int, tuple[float, float]]:
    """(accepted, verified) per draft position, served and scored rounds together, from `specd alpha --json`."""
    out: dict[int, tuple[float, float]] = {}
    for position in drafter["positions"] + drafter["counterfactual_positions"]:
        accepted, verified = out.get(position["position"], (0.0, 0.0))
        out[position["position"]] = (accepted + position["accepted"], verified + position["verified"])
    return out


def posterior_means(
    rounds: dict[int, tuple[float, float]], positions: int, start: float, strength: float
) -> list[float]:
    """The acceptance estimate per position a controller that learns from these rounds holds, written out here
    apart from controller/decision/decide.py: each position's Beta posterior mean, shrunk by ``strength`` pseudo-rounds
    towards the drafter's pooled rate in the segment, which is itself shrunk by as many towards ``start``."""
    seen = [rounds.get(i, (0.0, 0.0)) for i in range(positions)]
    pooled = (sum(a for a, _ in seen) + strength * start) / (sum(v for _, v in seen) + strength)
    return [(a + strength * pooled) / (v + strength) for a, v in seen]


def learned_and_unseen(address: str) -> tuple[dict, dict]:
    """`specd alpha --json` of UNRULED and of UNSEEN, read between two reads of UNSEEN that agree (a refresh of the
    fleet's figures between them moves where a new segment starts, and the reads would not be comparable)."""
    for _ in range(5):
        before = specd_cli("alpha", UNSEEN, "--json", "--address", address)[0]
        learned = specd_cli("alpha", UNRULED, "--json", "--address", address)[0]
        after = specd_cli("alpha", UNSEEN, "--json", "--address", address)[0]
        if before["drafters"] == after["drafters"]:
            return learned, after
    raise AssertionError("where a new segment starts moved at every read: no two reads agreed in 5 tries")


def policy_in_force(address: str) -> Policy:
    """`specd policy show`, parsed as the controller parses a policy file."""
    done = subprocess.run([sys.executable, "-m", "specd", "policy", "show", "--address", address],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return parse_policy(done.stdout, "specd policy show")


def decision(reply: Reply) -> tuple[str, int, str, str]:
    s = reply.specd
    return s["drafter"], s["k"], s["decision_reason"], s["decision_source"]


def print_timeline(replies: list[Reply]) -> None:
    for segment in sorted({r.segment for r in replies}):
        steps = [decision(r)[:3] for r in sorted(replies, key=lambda r: r.sent) if r.segment == segment]
        print(f"{segment:<12} " + " -> ".join(f"{d}/{k} ({why})" for d, k, why in steps))


def test_controller_learns_exactly_what_the_worker_decoded(stack: Stack) -> None:
    # A cold segment's expected speedup on the reference pair is about 1.11 (measured costs: c 0.185, v(4) 1.76,
    # AMD EPYC): 6% over the shipped min_speedup of 1.05, which a loaded moment in the worker's cost calibration
    # crossed (CI saw every cold segment off). At 1.0 the cold decisions below keep an 11% margin; nothing else here
    # depends on the threshold (the later checks compare with the controller's own estimates).
    shipped = POLICY.read_text()
    assert "min_speedup: 1.05 " in shipped
    controller = stack.start_controller(policy=shipped.replace("min_speedup: 1.05 ", "min_speedup: 1.0  "))
    # decisions from the controller: a deadline long enough that a loaded machine (a CI run beside other work) does
    # not turn them into the worker's fallbacks, which would keep the draft model off UNRULED (seen: 5 in a row)
    worker = stack.start_worker(controller.address, decide_deadline_ms=1000)
    one_each, unruled, rest = workload()
    cold = specd_cli("alpha", UNRULED, "--json", "--address", controller.address)[0]["decision"]

    with httpx.Client(base_url=worker.url, timeout=120) as http:

        def send(prompt: Prompt) -> Reply:
            return complete(http, prompt, MAX_TOKENS)

        first = in_threads(send, [unruled.pop(0), *one_each], THREADS)
        wait_for_reports(controller.address, http)
        # A fallback or a probe of "none" may have kept every drafter off UNRULED; the check below needs rounds of one
        # (which one is left open: waiting for the draft model's can take every UNRULED prompt into the first wave)
        while not any(s == UNRULED and d != "none" for s, d in controller_counts(controller.address)):
            assert len(unruled) > 2, "no drafter ever ran on UNRULED: no prompts left for the second wave"
            first.append(send(unruled.pop(0)))
            wait_for_reports(controller.address, http)
        # the second wave is decided with the first one's data
        second = in_threads(send, spread(rest, unruled), THREADS)
        metrics = wait_for_reports(controller.address, http)
    replies = first + second
    print_timeline(replies)

    # no request failed
    failed = [(r.segment, r.status, r.body) for r in replies if r.status != 200]
    assert not failed
    assert all(r.body["choices"][0]["finish_reason"] in ("length", "stop") for r in replies)
    assert metrics.total("specd_requests_total") == len(replies)

    # the controller's statistics are the worker's counters (as counts), and α is the same number
    summary = specd_cli("alpha", "--json", "--address", controller.address)
    ours = worker_counts(metrics)
    assert as_counts(alpha_json_counts(summary)) == as_counts(ours)
    positions = worker_positions(metrics)
    assert positions, "no draft tokens were proposed at all"
    assert as_counts(alpha_json_positions(summary)) == as_counts(positions)
    by_segment = {s["segment"]: s for s in summary}
    for (segment, drafter), (_, proposed, accepted) in ours.items():
        if proposed:
            assert abs(by_segment[segment]["alpha_by_drafter"][drafter] - accepted / proposed) < 1e-9

    # decisions follow policy rules and data (the controller's own answers; fallbacks and probes aside)
    answered = [r for r in replies if r.specd["decision_source"] == "controller" and not r.specd["exploration"]]
    assert {decision(r)[:3] for r in answered if r.segment == "adversarial"} == {("none", 0, "policy_off")}
    cold_others = [r for r in answered if r in first and r.segment not in ("adversarial", UNRULED)]
    # A cold segment is decided from the prior at the costs the worker measured, and the first wave runs in threads:
    # a report that lands mid-wave moves the fleet's figures and costs, so cold decisions may differ from each other.
    # Each follows the rule at its own estimate: off for low_expected_speedup only under min_speedup (1.0 here, the
    # lowest a policy takes), speculating only at or above it; a rule's "none" (a request whose few new tokens cannot
    # repay the draft model's prefill of its prompt) aside.
    for r in cold_others:
        drafter, _, why, _ = decision(r)
        if drafter == "none":
            assert why in ("low_expected_speedup", "request_too_short"), decision(r)
            if why == "low_expected_speedup":
                # at most, not under: the reply rounds the speedup to 4 places (0.99996 reads 1.0)
                assert r.specd["expected_speedup"] <= 1.0, (decision(r), r.specd["expected_speedup"])
        else:
            assert r.specd["expected_speedup"] >= 1.0, (decision(r), r.specd["expected_speedup"])
    # a segment nobody has seen is decided from the prior: the draft model (alone, or after prompt lookup: chain),
    # unless the worker's measured costs put every arm under min_speedup
    if cold["reason"] != "low_expected_speedup":
        assert cold["drafter"] in MODEL_DRAFTERS and cold["reason"] == "best_expected_speedup", cold
        # the first request of UNRULED, decided from the same figures, gets the same plan
        if first[0] in answered and abs(first[0].specd["expected_speedup"] - cold["expected_speedup"]) < 1e-3:
            assert decision(first[0])[0] == cold["drafter"], (decision(first[0]), cold)
    # ... and once its reports come in, its decisions follow them: each drafter's estimate is the posterior of the
    # rounds the worker ran and scored on UNRULED (checked equal to its counters above), from where UNSEEN starts,
    # and the plan it would give now is made with those estimates. A controller that kept the prior, or learned from
    # other counts (served rounds only, another segment's, the fleet's alone), fails here whichever plan wins.
    learned, unseen = learned_and_unseen(controller.address)
    starts = {d["drafter"]: d["acceptance"] for d in unseen["drafters"] if d["acceptance"]}
    estimates = {d["drafter"]: d["acceptance"] for d in learned["drafters"] if d["acceptance"]}
    strength = policy_in_force(controller.address).for_segment(UNRULED).prior_strength
    assert strength > 0 and estimates.keys() == starts.keys(), (strength, estimates.keys(), starts.keys())
    learned_from = []
    for d in learned["drafters"]:
        if not d["acceptance"]:
            continue
        start = starts[d["drafter"]]
        assert all(abs(a - start[0]) < 1e-12 for a in start), (d["drafter"], start)  # no rounds: the start itself
        rounds = evidence(d)
        expected = posterior_means(rounds, len(d["acceptance"]), start[0], strength)
        assert all(abs(a - b) < 1e-9 for a, b in zip(d["acceptance"], expected, strict=True)), (
            d["drafter"],
            d["acceptance"],
            expected,
            rounds,
            start[0],
            strength,
        )
        if any(v for _, v in rounds.values()):
            learned_from.append(d["drafter"])
    assert learned_from, "no drafter's rounds on UNRULED reached the controller: nothing to learn from"
    final = learned["decision"]
    assert final["reason"] in ("best_expected_speedup", "low_expected_speedup", "kept_previous"), final
    if final["drafter"] != "none":
        plan = final["acceptance"]
        assert len(plan) == final["k"], final
        assert all(abs(a - b) < 1e-9 for a, b in zip(plan, estimates[final["drafter"]], strict=False)), final


def test_a_worker_watching_the_decision_tables_decides_locally_once_a_segment_is_learned(stack: Stack) -> None:
    """`controller.watch_decisions: true`: the first requests of a segment are decided by Decide (the tables hold
    only segments with data); once its reports weigh as much as the prior, its requests are decided locally from
    the pushed table (decision_source "table"), and the controller still counts every round the worker ran."""
    controller = stack.start_controller()
    worker = stack.start_worker(controller.address, decide_deadline_ms=100, watch_decisions=True)
    prompts = [p for p in mixed_workload(8) if p.segment == "code"]
    with httpx.Client(base_url=worker.url, timeout=120) as http:
        replies = [complete(http, prompts[0], MAX_TOKENS)]
        metrics = wait_for_reports(controller.address, http)
        for prompt in prompts[1:]:
            replies.append(complete(http, prompt, MAX_TOKENS))
            metrics = wait_for_reports(controller.address, http)
    print_timeline(replies)
    assert all(r.status == 200 for r in replies), [(r.status, r.body) for r in replies]
    sources = [r.specd["decision_source"] for r in replies]
    assert sources[0] == "controller", sources  # nothing learned yet: not in the tables
    assert "table" in sources[2:], sources
    assert "last_decision" not in sources and "local_default" not in sources, sources
    summary = specd_cli("alpha", "--json", "--address", controller.address)
    assert as_counts(alpha_json_counts(summary)) == as_counts(worker_counts(metrics))
