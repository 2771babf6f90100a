"""The controller learns per segment, end to end, judged by running the arms, not by its own model.

Synthetic workers decode requests whose every round has a known cost (a target step of 10 ms, drafting c steps per
token, verification v(n) steps for n drafts, with v as measured on a CPU in float32: dear at 1-3 drafts, cheap at
4, dear again beyond, so the best K is interior) and known per-position acceptance. They ask Decide over real gRPC,
follow the plan as the real worker does (its round policy, ``specd_api.round_policy``, each round; prompt lookup
replayed counterfactually over every request), and report through the real client library's conversion into real
Redis (the embedded server).

The ground truth is what each static arm measures when run the same way: the best (drafter, K) per segment is the
one with the most tokens per simulated second. The controller must get close to it, keep a high-α segment on,
switch a low-α one off, and bring a segment back when its acceptance rises. Planted bugs that must fail here:
learned c scaled by 2.5 (the "mid" segment, which pays about 1.3x, is switched off), the verify cost's growth
ignored (K runs to the largest allowed, where v(n) is dear), and always the largest K.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from specd_api.plan import Plan
from specd_api.position_tally import PositionTally
from specd_api.round_policy import RoundPolicy
from specd_api.rounds import RoundRecord, Scored
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from specd_client.reports import rounds_to_aggregates
from tests.daemons import running_daemon

STEP_SECONDS = 0.010  # one target step
VERIFY = (1.0, 1.39, 1.71, 1.58, 1.21, 1.9, 2.3, 2.7, 3.1, 3.5, 3.9, 4.3, 4.7, 5.1, 5.5, 5.9, 6.3)  # v(n), n = 0..16
COST_RATIO = {"draft": 0.2, "prompt_lookup": 0.002}
TOKENS_PER_REQUEST = 96
K_MAX = {"draft": 8, "prompt_lookup": 10}  # the shipped policy's bounds
LOOKUP_K = K_MAX["prompt_lookup"]


@dataclass(frozen=True)
class Truth:
    """A segment's real behaviour: per-position acceptance of each drafter, and how far prompt lookup reaches."""

    draft: float
    lookup: float
    lookup_reach: float  # P(prompt lookup has a token at position i + 1 | it had one at i); position 0 too
    self_repetition: float  # what the worker measures on the prompt and sends with Decide

    def acceptance(self, drafter: str) -> float:
        return self.draft if drafter == "draft" else self.lookup


@dataclass
class Served:
    tokens: int
    seconds: float
    aggregates: list[pb.RoundsAggregate]


def decode(segment: str, truth: Truth, plan: Plan, rng: random.Random, stall: float = 0.0) -> Served:
    """One request run as the worker runs a plan: each round's K by its round policy (alone: batch 1), under the
    budget left; ``stall`` seconds added to its second round (the machine's, not the work's)."""
    policy, rounds, emitted, seconds = RoundPolicy.open(plan, plan.drafter), [], 0, 0.0
    while emitted < TOKENS_PER_REQUEST:
        k = policy.round_k(1, max(TOKENS_PER_REQUEST - emitted - 1, 0))
        n = proposed(plan.drafter, truth, k, rng)
        accepted = 0
        while accepted < n and rng.random() < truth.acceptance(plan.drafter):
            accepted += 1
        draft_s = STEP_SECONDS * COST_RATIO.get(plan.drafter, 0.0) * n
        verify_s = STEP_SECONDS * VERIFY[n] * rng.uniform(0.97, 1.03) + (stall if len(rounds) == 1 else 0.0)
        rounds.append(RoundRecord(plan.drafter if k else "none", k, n, accepted, accepted + 1, draft_s, verify_s))
        policy.observe(n, accepted)
        emitted += accepted + 1
        seconds += draft_s + verify_s
    scores_lookup = plan.counterfactual_ceiling("prompt_lookup") > 0 and plan.drafter != "prompt_lookup"
    scored = replay_lookup(truth, emitted, rng) if scores_lookup else []
    aggregates = rounds_to_aggregates(segment, rounds, 0.0, 200, truth.self_repetition, scored, plan.model_speedup)
    return Served(emitted, seconds, aggregates)


def proposed(drafter: str, truth: Truth, k: int, rng: random.Random) -> int:
    if drafter == "draft":
        return k
    n = 0
    while drafter == "prompt_lookup" and n < k and rng.random() < truth.lookup_reach:
        n += 1
    return n


def replay_lookup(truth: Truth, emitted: int, rng: random.Random) -> list[Scored]:
    """Prompt lookup replayed over the request's tokens, as the worker does (decoder.counterfactual): rounds at
    its ceiling, each starting after the previous one's accepted tokens and bonus token."""
    scored: dict[int, Scored] = {}
    done = 0
    while done < emitted:
        ceiling = min(LOOKUP_K, TOKENS_PER_REQUEST - done - 1)
        accepted = 0
        if ceiling > 0:
            n = proposed("prompt_lookup", truth, ceiling, rng)
            while accepted < n and rng.random() < truth.lookup:
                accepted += 1
            scored.setdefault(ceiling, Scored("prompt_lookup", ceiling, PositionTally.of_width(ceiling))).tally.add(
                n, accepted
            )
        done += accepted + 1
    return list(scored.values())


def static_throughput(truth: Truth, drafter: str, k: int, requests: int = 60) -> float:
    # a seed fixed across processes: hash() of a str is salted per interpreter (PYTHONHASHSEED), which would make the
    # measured ratios differ from run to run
    rng = random.Random(zlib.crc32(f"{drafter}:{k}".encode()))
    served = [decode("truth", truth, Plan(drafter, k), rng) for _ in range(requests)]
    return sum(s.tokens for s in served) / sum(s.seconds for s in served)


def ground_truth(truth: Truth) -> tuple[str, int, float]:
    """The best static arm by running every one: (drafter, K, tokens/s)."""
    arms = [("none", 0)] + [(d, k) for d, k_max in K_MAX.items() for k in range(1, k_max + 1)]
    measured = [(d, k, static_throughput(truth, d, k)) for d, k in arms]
    return max(measured, key=lambda arm: arm[2])


class FakeClock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def daemon(tmp_path: Path, embedded_redis_url: str):
    """A daemon (tests/daemons.py) on a clock the test moves: 10 s buckets, a 60 s half-life, refreshed when told."""
    clock = FakeClock()
    learning = {"bucket_seconds": 10, "half_life_seconds": 60, "refresh_seconds": 3600}
    with running_daemon(embedded_redis_url, tmp_path, clock=clock, learning=learning) as d:
        yield d, clock


class Worker:
    """Asks, decodes (synthetically) and reports, over gRPC."""

    def __init__(self, address: str, seed: int) -> None:
        self.stub = pb_grpc.ControllerStub(grpc.insecure_channel(address))
        self.rng = random.Random(seed)
        self.reports = 0

    def request(self, segment: str, truth: Truth, stall: float = 0.0) -> tuple[Plan, Served]:
        decision = self.stub.Decide(
            pb.DecideRequest(
                segment=segment,
                batch_size=1,
                drafters=["draft", "prompt_lookup"],
                max_new_tokens=TOKENS_PER_REQUEST,
                prompt_tokens=200,
                prompt_features=pb.PromptFeatures(self_repetition=truth.self_repetition),
            )
        )
        plan = Plan.from_proto(decision)
        served = decode(segment, truth, plan, self.rng, stall)
        self.reports += 1
        request = pb.ReportRoundsRequest(report_id=f"w{id(self)}-{self.reports}", aggregates=served.aggregates)
        self.stub.ReportRounds(request)
        return plan, served


def drive(daemon, clock, worker, truths: dict[str, Truth], requests: int) -> dict[str, list[tuple[Plan, Served]]]:
    """``requests`` per segment, interleaved; the snapshot is refreshed every 10 requests (1 fake second)."""
    served: dict[str, list[tuple[Plan, Served]]] = {s: [] for s in truths}
    for i in range(requests):
        for segment, truth in truths.items():
            served[segment].append(worker.request(segment, truth))
        if i % 10 == 9:
            clock.now += 1.0
            assert daemon.controller.learner.refresh()
    return served


def throughput(served: list[tuple[Plan, Served]]) -> float:
    return sum(s.tokens for _, s in served) / sum(s.seconds for _, s in served)


TRUTHS = {
    "code": Truth(draft=0.9, lookup=0.5, lookup_reach=0.4, self_repetition=0.3),
    "mid": Truth(draft=0.62, lookup=0.3, lookup_reach=0.3, self_repetition=0.1),
    "extractive": Truth(draft=0.55, lookup=0.95, lookup_reach=0.95, self_repetition=0.8),
    "creative": Truth(draft=0.2, lookup=0.1, lookup_reach=0.1, self_repetition=0.05),
}


def test_the_ground_truth_has_an_interior_best_k():
    # the harness itself: K = 8 is allowed, but v(n) makes the best draft K interior; and "mid" pays, modestly
    drafter, k, best = ground_truth(TRUTHS["code"])
    assert (drafter, 2 <= k <= 6) == ("draft", True), (drafter, k)
    assert static_throughput(TRUTHS["code"], "draft", 8) < 0.8 * best
    drafter, _, best = ground_truth(TRUTHS["mid"])
    none = static_throughput(TRUTHS["mid"], "none", 0)
    assert drafter == "draft" and 1.1 < best / none < 1.5, best / none  # 1.16-1.21 over 12 seeds
    assert ground_truth(TRUTHS["creative"])[0] == "none"


def test_decisions_converge_to_the_arms_best_switch_off_and_come_back(daemon):
    d, clock = daemon
    d.controller.reseed(1)  # what the controller learns here is the fleet the next test's segments start from
    worker = Worker(d.address, seed=1)
    truths = {**TRUTHS, "drift": TRUTHS["creative"]}
    phase1 = drive(d, clock, worker, truths, requests=150)

    for segment in ("code", "mid", "extractive"):
        drafter, k, best = ground_truth(truths[segment])
        late = phase1[segment][-50:]
        assert all(p.speculates for p, _ in late if not p.exploration), f"{segment} went off: it pays"
        got = throughput(late)
        assert got >= 0.93 * best, f"{segment}: {got:.1f} tok/s, the best arm ({drafter} K={k}) makes {best:.1f}"
    for segment in ("creative", "drift"):
        assert all(p.drafter == "none" for p, _ in phase1[segment][-40:] if not p.exploration), f"{segment} not off"
        none = static_throughput(truths[segment], "none", 0)
        assert throughput(phase1[segment][-50:]) >= 0.97 * none, f"{segment}: probing costs too much"

    # The drifting segment's traffic changes: its draft now agrees 90% of the time.
    truths = {"drift": Truth(draft=0.9, lookup=0.1, lookup_reach=0.1, self_repetition=0.05)}
    back_on_at = None
    for step in range(120):  # bound: two half-lives (120 fake seconds = 1,200 requests at 10 per second)
        served = drive(d, clock, worker, truths, requests=10)["drift"]
        exploits = [p for p, _ in served if not p.exploration]
        if exploits and all(p.drafter == "draft" for p in exploits):
            back_on_at = (step + 1) * 10
            break
    assert back_on_at is not None, "the segment never came back on after its acceptance rose"
    print(f"drift segment back on after {back_on_at} requests")


def test_a_new_segment_settles_within_six_requests_and_a_stalled_first_request_changes_nothing(daemon):
    # The fleet is known (the other segments ran); two new segments whose draft pays modestly (mid: about 1.2x)
    # arrive together, the first request of one of them stalled 1.5 s in a round (150 steps). From the 7th request
    # on, both run the draft model, as the best static arm does, whatever the stall did to the first request.
    d, clock = daemon
    # The worker's draws are seeded, and so are the controller's Thompson draws (Decide runs on one thread): a modest
    # segment whose first two requests happen to accept little goes off and comes back only through probes, which
    # some seeds show within 20 requests, and the claim here is about the stall, not about that luck.
    d.controller.reseed(4)
    worker = Worker(d.address, seed=4)
    drive(d, clock, worker, {s: TRUTHS[s] for s in ("code", "mid", "extractive", "creative")}, requests=40)
    truth = TRUTHS["mid"]
    plans: dict[str, list[Plan]] = {"quiet": [], "stalled": []}
    for i in range(20):
        for segment in plans:
            stall = 1.5 if segment == "stalled" and i == 0 else 0.0
            plans[segment].append(worker.request(f"new-{segment}", truth, stall)[0])
        clock.now += 0.1
        assert d.controller.learner.refresh()
    best = ground_truth(truth)[0]
    for segment, made in plans.items():
        late = [p for p in made[6:] if not p.exploration]
        # nearly all: a probe's rounds may move a modest segment for a request or two (Thompson draws are random)
        on_best = sum(p.drafter == best for p in late)
        assert late and on_best >= 0.8 * len(late), (segment, [(p.drafter, p.k) for p in made])
