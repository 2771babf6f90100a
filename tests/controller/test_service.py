"""The controller's gRPC API end to end: a real ControllerDaemon on a loopback socket, over the embedded Redis.

One daemon serves the whole module (start-up is the slow part); every test uses its own segment names, and
the policy test puts the original policy back. Counts are checked exactly: the half-life is set far beyond
the test's duration, so decay cannot scale them.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from controller.storage.redis_conn import make_client
from specd_api.checks import MAX_VERIFY_SECONDS_PER_ROUND, MIN_VERIFY_SECONDS_PER_ROUND
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.daemons import DEFAULT_POLICY, RPC_TIMEOUT, connected, running_daemon

SERVICE = "specd.v1.Controller"
REFRESH_WAIT = 2.0  # the daemon refreshes every 0.1 s; a report must be visible well within this


# --- fixtures -----------------------------------------------------------------------------------------
# The module's daemon (``daemon``: the default policy plus a rule that switches `forced-off*` segments off) is
# tests/controller/conftest.py's; tests/daemons.py starts it.


@pytest.fixture(scope="module")
def policy_path(daemon) -> Path:
    return Path(daemon.config.policy_path)


@pytest.fixture(scope="module")
def channel(daemon) -> Iterator[grpc.Channel]:
    with connected(daemon) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel) -> pb_grpc.ControllerStub:
    return pb_grpc.ControllerStub(channel)


# --- helpers ------------------------------------------------------------------------------------------


def decide(
    stub: pb_grpc.ControllerStub,
    segment: str,
    batch_size: int = 1,
    drafters: tuple[str, ...] = ("draft", "prompt_lookup"),
) -> pb.Decision:
    request = pb.DecideRequest(segment=segment, batch_size=batch_size, drafters=drafters, max_new_tokens=64)
    return stub.Decide(request, timeout=RPC_TIMEOUT)


def draft_aggregate(segment: str = "valid", **changes) -> pb.RoundsAggregate:
    """10 rounds of the draft model at K = 2: position 0 accepted 8 times of 10, position 1 4 times of 8. Served
    rounds carry the per-n timing table their rounds and positions imply (``per_drafted``), unless ``changes`` gives
    one."""
    fields = dict(
        segment=segment,
        drafter="draft",
        k=2,
        rounds=10,
        num_drafted=20,
        num_accepted=12,
        proposed_per_position=[10, 10],
        verified_per_position=[10, 8],  # position 1 is verified exactly when position 0 was accepted
        accepted_per_position=[8, 4],
        tokens_emitted=22,  # accepted + one bonus token per round
        draft_seconds=0.1,
        verify_seconds=0.2,
        batch_size=1,
    )
    fields.update(changes)
    served = fields["rounds"] > 0 and not fields.get("counterfactual")
    if served and "rounds_by_drafted" not in changes and "verify_seconds_by_drafted" not in changes:
        fields.update(per_drafted(fields["rounds"], fields["proposed_per_position"], fields["verify_seconds"]))
    return pb.RoundsAggregate(**fields)


def per_drafted(rounds: int, proposed_per_position: Sequence[int], verify_seconds: float) -> dict[str, list]:
    """The per-n timing table of ``rounds`` served rounds with these positions: ``rounds_by_drafted[n]`` the rounds
    that drafted exactly n tokens (position i is proposed in every round that drafted more than i), and
    ``verify_seconds`` shared among them by their rounds (each share within the per-round bounds the wire checks)."""
    proposed = list(proposed_per_position)
    counts = [more - fewer for more, fewer in zip([rounds, *proposed], [*proposed, 0], strict=True)]
    seconds = [
        min(max(verify_seconds * n_rounds / rounds, MIN_VERIFY_SECONDS_PER_ROUND * n_rounds),
            MAX_VERIFY_SECONDS_PER_ROUND * n_rounds)
        for n_rounds in counts
    ]  # fmt: skip
    return {"rounds_by_drafted": counts, "verify_seconds_by_drafted": seconds}


def lookup_aggregate(segment: str) -> pb.RoundsAggregate:
    """5 rounds of prompt lookup at K = 3 that often found fewer than 3 tokens to propose."""
    return pb.RoundsAggregate(
        segment=segment,
        drafter="prompt_lookup",
        k=3,
        rounds=5,
        num_drafted=9,
        num_accepted=3,
        proposed_per_position=[5, 3, 1],
        verified_per_position=[5, 2, 1],
        accepted_per_position=[2, 1, 0],
        tokens_emitted=8,
        draft_seconds=0.0,
        verify_seconds=0.1,
        batch_size=1,
        rounds_by_drafted=[0, 2, 2, 1],  # 5 rounds proposed a first token, 3 a second, 1 a third
        verify_seconds_by_drafted=[0.0, 0.04, 0.04, 0.02],
    )


def hopeless_aggregate(segment: str) -> pb.RoundsAggregate:
    """1000 rounds of the draft model at K = 4 in which the target rejected every first token (α = 0)."""
    return pb.RoundsAggregate(
        segment=segment,
        drafter="draft",
        k=4,
        rounds=1000,
        num_drafted=4000,
        num_accepted=0,
        proposed_per_position=[1000] * 4,
        verified_per_position=[1000, 0, 0, 0],
        accepted_per_position=[0] * 4,
        tokens_emitted=1000,
        draft_seconds=0.4,
        verify_seconds=30.0,
        batch_size=1,
        rounds_by_drafted=[0, 0, 0, 0, 1000],
        verify_seconds_by_drafted=[0.0, 0.0, 0.0, 0.0, 30.0],
    )


def report(*aggregates: pb.RoundsAggregate, report_id: str | None = None) -> pb.ReportRoundsRequest:
    return pb.ReportRoundsRequest(
        report_id=f"r-{uuid.uuid4().hex}" if report_id is None else report_id,
        worker_id="test-worker",
        aggregates=list(aggregates),
    )


def wait_for_stats(
    stub: pb_grpc.ControllerStub, segment: str, ready: Callable[[pb.SegmentStats], bool]
) -> pb.SegmentStats:
    """Poll GetSegmentStats until ``ready`` holds (the background refresh has seen the report)."""
    deadline = time.monotonic() + REFRESH_WAIT
    while True:
        stats = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=segment), timeout=RPC_TIMEOUT)
        if ready(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def by_drafter(stats: pb.SegmentStats, drafter: str) -> pb.DrafterStats:
    return next(d for d in stats.drafters if d.drafter == drafter)


# --- Decide -------------------------------------------------------------------------------------------


def test_daemon_listens_on_the_port_it_picked(daemon):
    assert daemon.port and daemon.port > 0
    assert daemon.address == f"127.0.0.1:{daemon.port}"


def test_decide_carries_the_version_of_the_policy_in_force(stub):
    policy = stub.GetPolicy(pb.GetPolicyRequest(), timeout=RPC_TIMEOUT)
    decision = decide(stub, "chat")
    assert decision.policy_version == policy.version
    assert decision.segment == "chat"
    assert decision.drafter in ("draft", "prompt_lookup", "none")
    # "none" drafts nothing; a drafter drafts at least one token (K within the default policy's bounds)
    assert (decision.drafter == "none") == (decision.k == 0)
    assert decision.k <= 10
    assert decision.expected_speedup > 0


@pytest.mark.parametrize(
    ("segment", "batch_size", "reason"),
    [
        # The default policy's max_batch_size is 8: one more switches speculation off (contract 6).
        ("chat", 9, "batch_size_above_threshold"),
        # The module's `forced-off*` rule forces "none".
        ("forced-off-prompts", 1, "policy_off"),
        # The batch rule comes first, even for a segment the policy switches off.
        ("forced-off-prompts", 9, "batch_size_above_threshold"),
    ],
)
def test_decide_switches_speculation_off_by_rule(stub, segment, batch_size, reason):
    decision = decide(stub, segment, batch_size)
    assert (decision.drafter, decision.k, decision.reason) == ("none", 0, reason)
    assert not decision.exploration  # rules come before any probing
    assert decision.expected_speedup == 1.0


def test_batch_at_the_threshold_is_not_switched_off_by_it(stub):
    # max_batch_size 8 means "off above 8": batch 8 itself is still judged on its merits.
    assert decide(stub, "chat", batch_size=8).reason != "batch_size_above_threshold"


@pytest.mark.parametrize(("segment", "batch_size"), [("chat", 1), ("chat", 9), ("forced-off-prompts", 1)])
def test_every_decision_carries_the_policys_batch_threshold(stub, segment, batch_size):
    """The worker applies the batch rule at every step with the policy's threshold (contract 6): each decision,
    speculating or not, carries it."""
    decision = decide(stub, segment, batch_size)
    assert decision.HasField("max_batch_size") and decision.max_batch_size == 8


# --- INVALID_ARGUMENT ---------------------------------------------------------------------------------


def decide_request(**changes) -> pb.DecideRequest:
    return pb.DecideRequest(**{"segment": "chat", "batch_size": 1, **changes})


def invalid(case_id: str, rpc: str, request_message, *named: str):
    """A request ``rpc`` must refuse, and the words its error details must contain (the field, at least)."""
    return pytest.param(rpc, request_message, named, id=case_id)


INVALID = [
    invalid("empty-segment", "Decide", decide_request(segment=""), "segment"),
    # segments are 1..128 characters
    invalid("long-segment", "Decide", decide_request(segment="a" * 129), "segment", "129"),
    # segments become Redis key parts: only [A-Za-z0-9_.:/-]; a space, a glob star or a newline is refused
    invalid("segment-space", "Decide", decide_request(segment="a b"), "segment"),
    invalid("segment-star", "Decide", decide_request(segment="tenant-*"), "segment"),
    invalid("segment-newline", "Decide", decide_request(segment="chat\n"), "segment"),
    # the worker can only offer drafters the controller knows
    invalid("decide-unknown-drafter", "Decide", decide_request(drafters=["medusa"]), "drafter", "medusa"),
    # a batch holds at least one sequence (0 is what an unset field reads as; negative is nonsense)
    invalid("negative-batch", "Decide", decide_request(batch_size=-1), "batch_size"),
    invalid("zero-batch", "Decide", decide_request(batch_size=0), "batch_size", "[1, "),
    # a hostile drafter name is quoted, cut short, never echoed whole
    invalid("long-unknown-drafter", "Decide", decide_request(drafters=["x" * 5000]), "drafters[0]", "xxx..."),
    # each drafter once: a list bounded only by the message size takes 27 ms to check in the handler
    invalid("too-many-drafters", "Decide", decide_request(drafters=["draft"] * 120_000), "drafters", "at most 16"),
    invalid(
        "nan-temperature",
        "Decide",
        decide_request(sampling=pb.SamplingParams(temperature=math.nan)),
        "sampling.temperature",
    ),
    # K is a count of tokens
    invalid("negative-k", "ReportRounds", report(draft_aggregate(k=-1)), "aggregates[0]", "k"),
    invalid("report-unknown-drafter", "ReportRounds", report(draft_aggregate(drafter="medusa")), "drafter", "medusa"),
    # "none" drafts nothing, so its K must be 0
    invalid("none-with-k", "ReportRounds", report(draft_aggregate(drafter="none")), "aggregates[0]", "k"),
    # timings feed the cost model: NaN or negative seconds would poison c and v(n)
    invalid("nan-draft-seconds", "ReportRounds", report(draft_aggregate(draft_seconds=math.nan)), "draft_seconds"),
    invalid("negative-verify-seconds", "ReportRounds", report(draft_aggregate(verify_seconds=-0.5)), "verify_seconds"),
    # a round takes time: zero seconds for rounds makes every cost ratio a division by zero (one such report
    # poisons every decision)
    invalid(
        "zero-seconds",
        "ReportRounds",
        report(
            draft_aggregate(
                rounds=1,
                num_drafted=2,
                num_accepted=0,
                proposed_per_position=[1, 1],
                verified_per_position=[1, 0],
                accepted_per_position=[0, 0],
                tokens_emitted=1,
                draft_seconds=0,
                verify_seconds=0,
            )
        ),
        "verify_seconds",
    ),
    # the per-n timing table must add up to the totals
    invalid(
        "by-drafted-rounds",
        "ReportRounds",
        report(draft_aggregate(rounds_by_drafted=[0, 0, 9], verify_seconds_by_drafted=[0, 0, 0.2])),
        "rounds_by_drafted",
    ),
    invalid(
        "by-drafted-seconds",
        "ReportRounds",
        report(draft_aggregate(rounds_by_drafted=[0, 0, 10], verify_seconds_by_drafted=[0, 0, 0.3])),
        "verify_seconds_by_drafted",
    ),
    # served rounds come with their per-n table (rounds_by_drafted): a served aggregate without one is refused
    invalid(
        "by-drafted-missing",
        "ReportRounds",
        report(draft_aggregate(rounds_by_drafted=[], verify_seconds_by_drafted=[])),
        "rounds_by_drafted",
    ),
    invalid(
        "by-drafted-longer-than-k",
        "ReportRounds",
        report(draft_aggregate(rounds_by_drafted=[0, 0, 0, 10], verify_seconds_by_drafted=[0, 0, 0, 0.2])),
        "rounds_by_drafted",
    ),
    # counterfactual rounds were scored, not run: they cannot carry timings
    invalid(
        "counterfactual-with-timings",
        "ReportRounds",
        report(draft_aggregate(drafter="prompt_lookup", counterfactual=True, tokens_emitted=0, draft_seconds=0)),
        "counterfactual",
    ),
    # position 1 accepted 4 times but verified only 3 times: more acceptances than trials
    invalid(
        "accepted-above-verified",
        "ReportRounds",
        report(draft_aggregate(verified_per_position=[10, 3])),
        "aggregates[0]",
        "position 1",
        "accepted",
        "verified",
    ),
    # Acceptance is a prefix: position 1 is verified only in rounds where position 0 was accepted, so
    # verified_per_position[1] <= accepted_per_position[0]. Here position 0 was accepted twice, yet
    # position 1 claims 10 verifications: refused.
    invalid(
        "verified-after-a-rejection",
        "ReportRounds",
        report(draft_aggregate(verified_per_position=[10, 10], accepted_per_position=[2, 10])),
        "aggregates[0]",
        "position 1",
        "verified",
    ),
    # K = 2 has two draft positions, not three
    invalid(
        "more-positions-than-k",
        "ReportRounds",
        report(draft_aggregate(proposed_per_position=[10, 10, 10])),
        "proposed_per_position",
    ),
    # the error names the bad aggregate, not just the first one
    invalid(
        "second-aggregate-bad",
        "ReportRounds",
        report(draft_aggregate(), draft_aggregate(rounds=-1)),
        "aggregates[1]",
        "rounds",
    ),
    # the idempotency key is required: without it a retry could not be told from a new report
    invalid("empty-report-id", "ReportRounds", report(draft_aggregate(), report_id=""), "report_id"),
    invalid("stats-bad-segment", "GetSegmentStats", pb.GetSegmentStatsRequest(segment="no spaces"), "segment"),
]


@pytest.mark.parametrize(("rpc", "request_message", "named"), INVALID)
def test_invalid_request_is_refused_with_the_field_named(stub, rpc, request_message, named):
    with pytest.raises(grpc.RpcError) as error:
        getattr(stub, rpc)(request_message, timeout=RPC_TIMEOUT)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    for part in named:
        assert part in error.value.details()


def test_server_still_answers_after_invalid_requests(stub, channel):
    # Runs after the table above (module order): none of those requests may have hurt the daemon.
    assert decide(stub, "chat", batch_size=9).reason == "batch_size_above_threshold"
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_rejected_report_stores_nothing(stub):
    # A report is all or nothing: a valid aggregate next to an invalid one is not stored either.
    rejected, sentinel = "rejected-report", "after-rejected-report"
    with pytest.raises(grpc.RpcError) as error:
        stub.ReportRounds(report(draft_aggregate(rejected), draft_aggregate(rejected, num_accepted=13)), timeout=5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stub.ReportRounds(report(draft_aggregate(sentinel)), timeout=RPC_TIMEOUT)
    assert wait_for_stats(stub, sentinel, lambda s: s.rounds > 0).rounds == pytest.approx(10)
    # the sentinel is visible, so a refresh ran after the rejected report: had it been stored, it would show
    assert stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=rejected), timeout=RPC_TIMEOUT).rounds == 0
    listed = stub.ListSegments(pb.ListSegmentsRequest(), timeout=RPC_TIMEOUT)
    assert rejected not in {s.segment for s in listed.segments}


# --- ReportRounds → statistics ------------------------------------------------------------------------


def test_reported_rounds_show_in_segment_stats(stub):
    segment = f"stored-{uuid.uuid4().hex[:8]}"
    response = stub.ReportRounds(report(draft_aggregate(segment), lookup_aggregate(segment)), timeout=RPC_TIMEOUT)
    assert (response.rounds_accepted, response.duplicate, response.journaled) == (15, False, False)

    stats = wait_for_stats(stub, segment, lambda s: s.rounds >= 15)
    assert stats.segment == segment
    assert stats.rounds == pytest.approx(15)
    assert not stats.stale
    assert stats.last_update_unix == pytest.approx(time.time(), abs=30)

    draft = by_drafter(stats, "draft")
    [k2] = draft.by_k
    assert (k2.drafter, k2.k) == ("draft", 2)
    assert (k2.rounds, k2.proposed, k2.accepted) == pytest.approx((10, 20, 12))
    assert k2.alpha == pytest.approx(12 / 20)
    assert k2.alpha_ci_low < k2.alpha < k2.alpha_ci_high  # 20 trials: a wide interval around 0.6
    assert k2.alpha_ci_low >= 0.0
    assert k2.alpha_ci_high <= 1.0
    assert k2.mean_accepted_length == pytest.approx((12 + 10) / 10)  # τ = accepted + 1 bonus per round
    assert k2.expected_speedup > 0
    # per position: (offered, proposed, verified, accepted, accepted / verified, accepted / offered)
    positions = [(p.offered, p.proposed, p.verified, p.accepted, p.conditional_alpha, p.alpha) for p in draft.positions]
    assert [p.position for p in draft.positions] == [0, 1]
    assert positions[0] == pytest.approx((10, 10, 10, 8, 0.8, 0.8))
    assert positions[1] == pytest.approx((10, 10, 8, 4, 0.5, 0.4))

    lookup = by_drafter(stats, "prompt_lookup")
    [k3] = lookup.by_k
    assert (k3.k, k3.rounds, k3.proposed, k3.accepted) == pytest.approx((3, 5, 9, 3))
    assert k3.alpha == pytest.approx(3 / 9)  # α is per proposed token, not per offered slot
    assert k3.alpha_ci_low < k3.alpha < k3.alpha_ci_high
    positions = [(p.offered, p.proposed, p.verified, p.accepted) for p in lookup.positions]
    expected = [(5, 5, 5, 2), (5, 3, 2, 1), (5, 1, 1, 0)]  # offered counts every round with K > i
    assert len(positions) == len(expected)
    for got, want in zip(positions, expected, strict=True):
        assert got == pytest.approx(want)

    listed = stub.ListSegments(pb.ListSegmentsRequest(), timeout=RPC_TIMEOUT)
    entry = next(s for s in listed.segments if s.segment == segment)
    assert entry.rounds == pytest.approx(15)


def test_duplicate_report_id_is_acknowledged_but_not_counted(stub):
    segment, sentinel = f"dup-{uuid.uuid4().hex[:8]}", f"dup-sentinel-{uuid.uuid4().hex[:8]}"
    first = report(draft_aggregate(segment))
    assert stub.ReportRounds(first, timeout=RPC_TIMEOUT).rounds_accepted == 10
    assert wait_for_stats(stub, segment, lambda s: s.rounds >= 10).rounds == pytest.approx(10)

    again = stub.ReportRounds(first, timeout=RPC_TIMEOUT)  # a worker's retry: same report_id
    assert (again.duplicate, again.rounds_accepted) == (True, 0)

    # Once a later report is visible, a refresh ran after the duplicate; the counts must not have moved.
    stub.ReportRounds(report(draft_aggregate(sentinel)), timeout=RPC_TIMEOUT)
    wait_for_stats(stub, sentinel, lambda s: s.rounds >= 10)
    stats = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=segment), timeout=RPC_TIMEOUT)
    assert stats.rounds == pytest.approx(10)
    assert by_drafter(stats, "draft").by_k[0].accepted == pytest.approx(12)


def test_stats_of_an_unseen_segment_are_empty_but_answered(stub):
    stats = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment="never-reported"), timeout=RPC_TIMEOUT)
    assert stats.rounds == 0
    assert all(not d.by_k and not d.positions for d in stats.drafters)
    assert stats.decision.policy_version  # what Decide would answer now, from the prior


# --- policies -----------------------------------------------------------------------------------------


def test_reload_refuses_an_invalid_policy_and_applies_a_valid_one(stub, policy_path):
    original = policy_path.read_text()
    old = stub.GetPolicy(pb.GetPolicyRequest(), timeout=RPC_TIMEOUT)
    try:
        # min_speedup below 1 would speculate where it slows decoding down; it sits on line 3.
        policy_path.write_text("defaults:\n  max_batch_size: 8\n  min_speedup: 0.5\n")
        with pytest.raises(grpc.RpcError) as error:
            stub.ReloadPolicy(pb.ReloadPolicyRequest(), timeout=RPC_TIMEOUT)
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = error.value.details()
        assert f"{policy_path}:3" in details  # file and line
        assert "defaults.min_speedup" in details  # field
        kept = stub.GetPolicy(pb.GetPolicyRequest(), timeout=RPC_TIMEOUT)
        assert (kept.version, kept.text) == (old.version, old.text)
        assert decide(stub, "chat", batch_size=9).policy_version == old.version

        # A valid change: speculation off above batch 4 instead of 8.
        policy_path.write_text(original.replace("max_batch_size: 8", "max_batch_size: 4"))
        new = stub.ReloadPolicy(pb.ReloadPolicyRequest(), timeout=RPC_TIMEOUT)
        assert new.version != old.version
        assert new.path == str(policy_path)
        assert "max_batch_size: 4" in new.text
        assert stub.GetPolicy(pb.GetPolicyRequest(), timeout=RPC_TIMEOUT).version == new.version
        decision = decide(stub, "chat", batch_size=5)
        assert (decision.reason, decision.policy_version) == ("batch_size_above_threshold", new.version)
    finally:
        policy_path.write_text(original)
        assert stub.ReloadPolicy(pb.ReloadPolicyRequest(), timeout=RPC_TIMEOUT).version == old.version


# --- standard services --------------------------------------------------------------------------------


@pytest.mark.parametrize("service", ["", SERVICE])
def test_health_service_says_serving(channel, service):
    response = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=RPC_TIMEOUT
    )
    assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_health_of_an_unknown_service_is_not_found(channel):
    with pytest.raises(grpc.RpcError) as error:
        health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="specd.v1.Nothing"), timeout=RPC_TIMEOUT
        )
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def reflect(channel: grpc.Channel, request: reflection_pb2.ServerReflectionRequest):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    [response] = list(stub.ServerReflectionInfo(iter([request]), timeout=RPC_TIMEOUT))
    return response


def test_reflection_lists_the_controller(channel):
    response = reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in response.list_services_response.service}
    assert {SERVICE, "grpc.health.v1.Health"} <= names


def test_reflection_serves_the_controller_descriptor(channel):
    # grpcurl and friends need the file descriptor, not just the name
    response = reflect(channel, reflection_pb2.ServerReflectionRequest(file_containing_symbol=SERVICE))
    assert response.file_descriptor_response.file_descriptor_proto
    assert b"specd_api/v1/controller.proto" in response.file_descriptor_response.file_descriptor_proto[0]


# --- decisions after unusual reports ----------------------------------------------------------------------
# These run on a daemon of their own (their reports would disturb the module's), with exploration off so
# that Decide answers deterministically.


@pytest.fixture
def fresh(embedded_redis_url, tmp_path) -> Iterator[Callable[..., pb_grpc.ControllerStub]]:
    """Start a daemon of the test's own: ``fresh(**learning_config)`` returns a stub connected to it."""
    policy = DEFAULT_POLICY.read_text().replace("exploration_rate: 0.25", "exploration_rate: 0.0 ")
    assert "exploration_rate: 0.0 " in policy
    with ExitStack() as stack:

        def start(**learning) -> pb_grpc.ControllerStub:
            daemon = stack.enter_context(running_daemon(embedded_redis_url, tmp_path, policy, learning=learning))
            return pb_grpc.ControllerStub(stack.enter_context(connected(daemon)))

        yield start


def stats_decision(stub: pb_grpc.ControllerStub, segment: str) -> pb.Decision:
    return stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=segment), timeout=RPC_TIMEOUT).decision


def test_a_new_report_is_never_acknowledged_as_a_duplicate(fresh):
    """The Lua script (store.py ingest) sums rounds as a Lua double and returns it as an integer reply; at 2^63 that
    wraps negative, and ``IngestResult`` reads any negative reply as "duplicate". Absurd counts are refused at the
    door, or counted right."""
    stub = fresh()
    absurd = pb.RoundsAggregate(segment="huge", drafter="none", rounds=2**63 - 1, batch_size=1)
    try:
        response = stub.ReportRounds(report(absurd), timeout=RPC_TIMEOUT)
    except grpc.RpcError as error:  # refusing an absurd count is as good as counting it right
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "rounds" in error.details()
        return
    assert not response.duplicate, "a report_id never seen before was acknowledged as a duplicate"
    assert response.rounds_accepted == 2**63 - 1


@pytest.mark.parametrize(
    "draft_seconds",
    [
        0.01,  # control: a sane timing (0.5 ms per drafted token) leaves the draft model on
        1.7e9,  # a worker bug: the clock's time sent as a duration
    ],
)
def test_one_report_cannot_switch_the_draft_model_off_everywhere(fresh, draft_seconds):
    """c is a ratio of sums over all segments, so timings checked only to be finite and >= 0 would let one report
    of 10 rounds from one segment set c ~ 1e11 for every segment. Such a report is refused at the door."""
    stub = fresh()
    assert stats_decision(stub, "chat").drafter == "draft"  # the default prior (α 0.6, c 0.1): speculate
    try:
        stub.ReportRounds(report(draft_aggregate("clock-bug", draft_seconds=draft_seconds)), timeout=RPC_TIMEOUT)
    except grpc.RpcError as error:  # refusing the absurd timing is right too
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "draft_seconds" in error.details()
        return
    wait_for_stats(stub, "clock-bug", lambda s: s.rounds >= 10)
    assert stats_decision(stub, "chat").drafter == "draft"


def test_a_segment_beyond_the_cap_is_decided_from_the_overflow_statistics(fresh):
    """Once max_segments is reached, a new segment's telemetry is counted under _overflow (store.py), and its own
    counts stay empty forever: Decide (service.Controller.decide) decides it from the overflow segment's counts and
    says so in Decision.segment."""
    stub = fresh(max_segments=1)
    for segment in ("first", "second"):  # the cap is one segment: "second" is counted under _overflow
        stub.ReportRounds(report(hopeless_aggregate(segment)), timeout=RPC_TIMEOUT)
    wait_for_stats(stub, "_overflow", lambda s: s.rounds >= 1000)
    assert decide(stub, "first", drafters=("draft",)).drafter == "none"  # control: a tracked segment learns
    decision = decide(stub, "second", drafters=("draft",))
    assert decision.segment == "_overflow"
    assert decision.drafter == "none"


def test_unprofitable_drafting_is_not_reported_as_a_short_request(fresh):
    """Arms whose expected speedup is below 1 fail ``repays_drafting`` (negative saving); decide.decide answers
    "low_expected_speedup" for them, not "request_too_short" for a 64-token request, so that hysteresis sees the
    segment switched off."""
    stub = fresh()
    stub.ReportRounds(report(hopeless_aggregate("hopeless")), timeout=RPC_TIMEOUT)
    wait_for_stats(stub, "hopeless", lambda s: s.rounds >= 1000)
    decision = decide(stub, "hopeless", drafters=("draft",))  # 64 new tokens, far above min_new_tokens (4)
    assert decision.drafter == "none"
    assert decision.reason == "low_expected_speedup"


def counterfactual_lookup(
    segment: str, rounds: int, accepted_at_0: int, drafter: str = "prompt_lookup"
) -> pb.RoundsAggregate:
    """Prompt lookup (or another one-hot ``drafter``) scored on ``rounds`` rounds of another drafter: one token
    proposed per round."""
    return pb.RoundsAggregate(
        segment=segment, drafter=drafter, k=1, rounds=rounds, num_drafted=rounds, num_accepted=accepted_at_0,
        proposed_per_position=[rounds], verified_per_position=[rounds], accepted_per_position=[accepted_at_0],
        batch_size=1, counterfactual=True,
    )  # fmt: skip


def test_counterfactual_rounds_are_shown_apart_and_decide_alone(fresh):
    # No prompt lookup round was ever served in this segment; its counterfactual record says it would have been
    # accepted 990 times in 1000 at the first position, which is enough to pick it without a single probe.
    stub = fresh()
    stub.ReportRounds(report(counterfactual_lookup("scored", 1000, 990)), timeout=RPC_TIMEOUT)
    stats = wait_for_stats(stub, "scored", lambda s: any(d.counterfactual_positions for d in s.drafters))
    lookup = by_drafter(stats, "prompt_lookup")
    assert not lookup.positions and not lookup.by_k, "scored rounds are not served rounds"
    [first] = lookup.counterfactual_positions
    assert (first.verified, first.accepted) == pytest.approx((1000, 990))
    assert lookup.acceptance[0] > 0.9  # the estimate decisions use includes them
    assert stats.rounds == 0  # rounds served: none
    assert decide(stub, "scored", drafters=("prompt_lookup",)).drafter == "prompt_lookup"


def test_suffix_decoding_scored_counterfactually_is_learned_and_chosen_without_a_probe(fresh):
    # What a worker reports for suffix decoding replayed over requests another drafter served: accepted at the door,
    # kept apart from served rounds, and enough to choose it without a probe.
    stub = fresh()
    stub.ReportRounds(report(counterfactual_lookup("sfx", 1000, 990, drafter="suffix")), timeout=RPC_TIMEOUT)
    stats = wait_for_stats(stub, "sfx", lambda s: any(d.counterfactual_positions for d in s.drafters))
    suffix = by_drafter(stats, "suffix")
    assert not suffix.positions and suffix.counterfactual_positions[0].accepted == pytest.approx(990)
    decisions = [decide(stub, "sfx", drafters=("suffix",)) for _ in range(40)]
    assert all(d.drafter == "suffix" and d.counterfactual_ks["suffix"] > 0 for d in decisions)
    assert not any(d.exploration for d in decisions)


def test_costs_are_learned_per_n_from_the_timing_tables(fresh):
    # 40 plain rounds of 10 ms, and rounds verifying 2 drafts at 30 ms (v = 3.0) and 4 drafts at 15 ms (v = 1.5):
    # not a line through v(0), v(2) and v(4) (least squares would put v(4) near 3.7). And 10 rounds verifying 1
    # draft at 50 ms: too few to trust (a busy moment), so v(1) is interpolated instead.
    stub = fresh()
    plain = pb.RoundsAggregate(segment="costs", drafter="none", rounds=40, tokens_emitted=40, verify_seconds=0.4,
                               batch_size=1, rounds_by_drafted=[40], verify_seconds_by_drafted=[0.4])  # fmt: skip
    drafted = pb.RoundsAggregate(
        segment="costs", drafter="draft", k=4, rounds=50, num_drafted=130, num_accepted=0,
        proposed_per_position=[50, 50, 20, 10], verified_per_position=[50, 0, 0, 0], accepted_per_position=[0] * 4,
        tokens_emitted=50, draft_seconds=0.13, verify_seconds=1.4, batch_size=1,
        rounds_by_drafted=[0, 10, 20, 0, 20], verify_seconds_by_drafted=[0, 0.5, 0.6, 0, 0.3],
    )  # fmt: skip
    stub.ReportRounds(report(plain, drafted), timeout=RPC_TIMEOUT)
    deadline = time.monotonic() + REFRESH_WAIT
    while not (costs := stub.GetCosts(pb.GetCostsRequest(), timeout=RPC_TIMEOUT)).buckets:
        assert time.monotonic() < deadline, "the costs never showed"
        time.sleep(0.05)
    [bucket] = costs.buckets
    assert (bucket.batch_bucket, bucket.measured) == (1, True)
    assert bucket.step_seconds == pytest.approx(0.010)
    assert list(bucket.verify_cost) == pytest.approx([1.0, 2.0, 3.0, 2.25, 1.5])  # 1 and 3 interpolated
    assert list(bucket.verify_rounds) == pytest.approx([40, 0, 20, 0, 20])
    assert bucket.cost_ratio["draft"] == pytest.approx(0.13 / 130 / 0.010)  # 1 ms per token over a 10 ms step


@pytest.mark.parametrize(
    "poison",
    [
        {"k|draft|4|rounds": "1", "k|draft|4|proposed": "0", "p|draft|0|verified": "0"},  # ratios of zeros
        {"p|draft|0|verified": "nan", "p|draft|0|accepted": "inf", "k|draft|4|rounds": "-5"},  # not numbers
        {"p|draft|x|verified": "3", "k|draft|four|rounds": "1", "p|draft|0|accepted": "not a number"},  # garbage
    ],
)
def test_stored_data_never_breaks_a_decision(fresh, embedded_redis_url, poison):
    # Whatever sits in Redis (a bug, a hand edit, another program), every read answers (contract 7).
    stub = fresh()
    stub.ReportRounds(report(draft_aggregate("poisoned")), timeout=RPC_TIMEOUT)
    wait_for_stats(stub, "poisoned", lambda s: s.rounds >= 10)
    client = make_client(embedded_redis_url, 2.0)
    [key] = list(client.scan_iter("*:seg:{poisoned}:*"))  # the segment's hash tag (controller/storage/store.py)
    client.hset(key, mapping=poison)
    for k in client.scan_iter("*:cost:*"):
        # zero seconds for 9 rounds (a step of 0 s), negative drafting time (numbers, so later reports still add)
        client.hset(k, mapping={"w|0|1|s": "0", "w|0|1|r": "9", "e|draft|1|s": "-1", "e|draft|1|n": "0"})
    # Once a later report shows, a refresh has read the poison (a refresh that failed on it would never show it:
    # the report goes straight to Redis, and only a refresh brings it into the statistics).
    assert not stub.ReportRounds(report(draft_aggregate("after-poison")), timeout=RPC_TIMEOUT).journaled
    assert wait_for_stats(stub, "after-poison", lambda s: s.rounds >= 10).rounds >= 10
    decision = decide(stub, "poisoned")
    assert decision.policy_version and math.isfinite(decision.expected_speedup)
    assert all(math.isfinite(a) and 0 <= a <= 1 for a in decision.acceptance)
    stats = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment="poisoned"), timeout=RPC_TIMEOUT)
    for drafter in stats.drafters:
        numbers = [p.conditional_alpha for p in drafter.positions] + [k.alpha for k in drafter.by_k]
        assert all(math.isfinite(x) for x in [*numbers, *drafter.acceptance, drafter.cost_ratio])
    assert stub.ListSegments(pb.ListSegmentsRequest(), timeout=RPC_TIMEOUT).segments
    assert stub.GetCosts(pb.GetCostsRequest(), timeout=RPC_TIMEOUT) is not None
    client.close()
