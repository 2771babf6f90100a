"""Every RPC of the Controller service under hostile input (hypothesis), over a real daemon on a loopback socket: no
crash, no hang, no poisoned state.

Requests are drawn from the proto's own descriptors (tests/controller/proto_strategies.py: a field added to the
proto is fuzzed without a change here), as well-formed messages with hostile values and as raw bytes written record
by record (strings that are not UTF-8, wrongly typed and cut fields) or at random. Every call must end within its
deadline with OK, INVALID_ARGUMENT, or RESOURCE_EXHAUSTED (a message over the size limit), never UNKNOWN or
INTERNAL. Reports that could have happened, with extreme values, are stored and must not break a decision later; a
report that is refused must change nothing: a control segment's totals are checked against what was accepted.
Run counts and the status codes drawn: `pytest --hypothesis-show-statistics tests/controller/test_fuzz_grpc.py`.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from controller.server import ControllerDaemon
from specd_api.checks import MAX_AGGREGATES, MAX_K
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.controller.proto_strategies import SEGMENT_CHARS, messages, wire
from tests.controller.test_service import RPC_TIMEOUT, connected, decide, draft_aggregate, report, running_daemon
from tests.controller.yaml_strategies import DEFAULT_TEXT, mutated_default_documents, policy_files
from tests.fuzzing import fuzz_settings

SERVICE = pb.DESCRIPTOR.services_by_name["Controller"]
METHODS = {m.name: m for m in SERVICE.methods}
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
CONTROL = "fuzz-control"  # a segment no strategy can name (its letters are not SEGMENT_CHARS)
assert not set(CONTROL) <= set(SEGMENT_CHARS)
WAIT_FOR_REFRESH = 3.0  # the daemon refreshes every 0.1 s


def examples_for(name: str) -> int:
    """Messages without fields have little to vary; ReloadPolicy re-reads the file (0.25 s to see it stable)."""
    if name == "ReloadPolicy":
        return 4
    return 100 if METHODS[name].input_type.fields else 10


# --- the daemon, and what the fuzzing may and may not change ---------------------------------------------


class Ledger:
    """The control segment's rounds that accepted reports added: what its stored total must be."""

    def __init__(self) -> None:
        self.control_rounds = 0
        self.segments: set[str] = {CONTROL}  # segments that accepted reports touched, re-checked at the end


@pytest.fixture(scope="module")
def daemon(embedded_redis_url, tmp_path_factory) -> Iterator[ControllerDaemon]:
    with running_daemon(embedded_redis_url, tmp_path_factory.mktemp("fuzz-daemon"), DEFAULT_TEXT) as d:
        yield d


@pytest.fixture(scope="module")
def channel(daemon) -> Iterator[grpc.Channel]:
    with connected(daemon) as channel:
        yield channel


@pytest.fixture(scope="module")
def stub(channel) -> pb_grpc.ControllerStub:
    return pb_grpc.ControllerStub(channel)


@pytest.fixture(scope="module")
def ledger(stub) -> Ledger:
    ledger = Ledger()
    stub.ReportRounds(report(draft_aggregate(CONTROL)), timeout=RPC_TIMEOUT)
    ledger.control_rounds = 10
    wait_for_control(stub, ledger)
    return ledger


def call(channel: grpc.Channel, method: str, request: bytes) -> grpc.StatusCode:
    """Send ``request`` as the serialized request of ``method``; its status (the response bytes are not parsed)."""
    rpc = channel.unary_unary(f"/{SERVICE.full_name}/{method}")  # no serializers: bytes in, bytes out
    try:
        rpc(request, timeout=RPC_TIMEOUT)
        code = grpc.StatusCode.OK
    except grpc.RpcError as e:
        code = e.code()
    event(f"{method}: {code.name}")
    return code


def assert_allowed(code: grpc.StatusCode, method: str) -> None:
    assert code in ALLOWED, f"{method} answered {code.name}"


def control_rounds(stub: pb_grpc.ControllerStub) -> float:
    stats = stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=CONTROL), timeout=RPC_TIMEOUT)
    return sum(k.rounds for d in stats.drafters for k in d.by_k)


def wait_for_control(stub: pb_grpc.ControllerStub, ledger: Ledger) -> None:
    """The control segment's stored rounds reach the ledger's (the refresh runs in the background); never more."""
    deadline = time.monotonic() + WAIT_FOR_REFRESH
    while not math.isclose(stored := control_rounds(stub), ledger.control_rounds, rel_tol=1e-4):
        assert time.monotonic() < deadline, f"control segment holds {stored} rounds, accepted {ledger.control_rounds}"
        time.sleep(0.05)


def assert_unpoisoned(stub: pb_grpc.ControllerStub, ledger: Ledger) -> None:
    """Well-formed calls still answer, for every segment an accepted report touched; the control totals are exact."""
    wait_for_control(stub, ledger)
    time.sleep(0.3)  # a few refreshes: whatever the fuzzing stored is in the snapshot now
    for segment in sorted(ledger.segments):
        plan = decide(stub, segment)
        assert plan.drafter in ("draft", "prompt_lookup", "none")
        assert math.isfinite(plan.expected_speedup), plan
        stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=segment), timeout=RPC_TIMEOUT)
    listed = stub.ListSegments(pb.ListSegmentsRequest(), timeout=RPC_TIMEOUT)
    assert CONTROL in {s.segment for s in listed.segments}
    stub.GetCosts(pb.GetCostsRequest(), timeout=RPC_TIMEOUT)
    stub.GetPolicy(pb.GetPolicyRequest(), timeout=RPC_TIMEOUT)
    wait_for_control(stub, ledger)


# --- every RPC: hostile values in well-formed messages, then hostile bytes ----------------------------------


def giant_examples(method: str) -> list[bytes]:
    """Repeated fields at and past their bounds, and a message past gRPC's 4 MB limit."""
    if method == "Decide":
        return [
            pb.DecideRequest(segment="s", batch_size=1, drafters=["draft"] * 100_000).SerializeToString(),
            pb.DecideRequest(segment="s", batch_size=1, drafters=["prompt_lookup"] * 400_000).SerializeToString(),
        ]
    if method == "ReportRounds":
        empty = pb.RoundsAggregate(segment="s", drafter="none", batch_size=1)
        return [
            pb.ReportRoundsRequest(report_id="r", aggregates=[empty] * (MAX_AGGREGATES + 1)).SerializeToString(),
            pb.ReportRoundsRequest(
                report_id="r", aggregates=[draft_aggregate("s", proposed_per_position=[10] * 100_000)]
            ).SerializeToString(),
        ]
    return []


@pytest.mark.parametrize("method", sorted(METHODS))
def test_any_message_is_answered_ok_or_invalid_argument(channel, stub, ledger, method: str):
    descriptor = METHODS[method].input_type

    @given(request=messages(descriptor).map(lambda m: m.SerializeToString()))
    @fuzz_settings(examples_for(method))
    def fuzz(request: bytes) -> None:
        assert_allowed(call(channel, method, request), method)

    for request in giant_examples(method):
        fuzz = example(request=request)(fuzz)
    fuzz()
    assert_unpoisoned(stub, ledger)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_any_bytes_are_answered_ok_or_invalid_argument(channel, stub, ledger, method: str):
    descriptor = METHODS[method].input_type

    @given(request=st.one_of(wire(descriptor), st.binary(max_size=64)))
    @example(request=b"\x0a\x02\xff\xfe")  # field 1 (every request's first string) holding bytes that are not UTF-8
    @example(request=b"\x0a\x05")  # a length past the end
    @example(request=b"\xff")  # a cut tag
    @fuzz_settings(examples_for(method))
    def fuzz(request: bytes) -> None:
        assert_allowed(call(channel, method, request), method)

    fuzz()
    assert_unpoisoned(stub, ledger)


# --- reports: refused ones change nothing; stored ones, however extreme, break nothing ------------------------


@st.composite
def plausible_aggregates(draw: st.DrawFn, segment: st.SearchStrategy[str]) -> pb.RoundsAggregate:
    """Rounds that could have happened (specd_api.checks accepts them), at extreme values: up to 10^9 rounds, K up to
    64, acceptance from none to all, timings from the fastest plausible to the slowest."""
    drafter = draw(st.sampled_from(["draft", "prompt_lookup", "none"]))
    k = 0 if drafter == "none" else draw(st.integers(1, MAX_K))
    rounds = draw(st.sampled_from([0, 1, 2, 10, 10**9]) | st.integers(0, 10**9))
    share = st.floats(0, 1)
    proposed, verified, accepted = [], [], []
    for i in range(k):
        p = round((proposed[-1] if i else rounds) * draw(share))
        v = p if i == 0 else min(p, round(accepted[-1] * draw(share)))
        proposed.append(p)
        verified.append(v)
        accepted.append(round(v * draw(share)))
    drafted, num_accepted = sum(proposed), sum(accepted)
    counterfactual = drafter != "none" and draw(st.booleans())
    a = pb.RoundsAggregate(
        segment=draw(segment), drafter=drafter, k=k, rounds=rounds, num_drafted=drafted, num_accepted=num_accepted,
        proposed_per_position=proposed, verified_per_position=verified, accepted_per_position=accepted,
        batch_size=draw(st.sampled_from([1, 2, 1_000_000]) | st.integers(1, 1_000_000)),
        temperature=draw(st.floats(0, 100, width=32)), prompt_tokens=draw(st.integers(0, (1 << 31) - 1)),
        self_repetition=draw(st.floats(0, 1, width=32)), counterfactual=counterfactual,
    )  # fmt: skip
    if not counterfactual:
        a.tokens_emitted = draw(st.integers(0, rounds * (k + 1)))
        a.draft_seconds = draw(st.sampled_from([0.0, 1e-9]) | st.floats(0, 10.0 * max(drafted, rounds, 1)))
        a.verify_seconds = draw(st.floats(1e-7 * rounds, 60.0 * max(rounds, 1)).filter(lambda s: s >= 1e-7 * rounds))
        if rounds and drafted % rounds == 0 and draw(st.booleans()):  # every round drafted the same number
            n = drafted // rounds
            a.rounds_by_drafted.extend([0] * n + [rounds])
            a.verify_seconds_by_drafted.extend([0.0] * n + [a.verify_seconds])
    return a


fuzz_segments = st.text(alphabet=SEGMENT_CHARS, min_size=1, max_size=128)


@given(aggregates=st.lists(plausible_aggregates(fuzz_segments), min_size=1, max_size=4))
@example(aggregates=[draft_aggregate("zero", draft_seconds=0.0, verify_seconds=1e-7, rounds=1, num_drafted=2,
                                     num_accepted=2, proposed_per_position=[1, 1], verified_per_position=[1, 1],
                                     accepted_per_position=[1, 1], tokens_emitted=3)])  # fmt: skip
@fuzz_settings(60)
def test_stored_reports_never_break_a_decision(channel, stub, ledger, aggregates: list[pb.RoundsAggregate]):
    request = pb.ReportRoundsRequest(report_id=f"fuzz-{uuid.uuid4().hex}", worker_id="fuzz", aggregates=aggregates)
    code = call(channel, "ReportRounds", request.SerializeToString())
    assert code == grpc.StatusCode.OK, f"a plausible report was refused ({code.name}): {request}"
    ledger.segments.update(a.segment for a in aggregates)
    for a in aggregates:  # a decision and the statistics right away (the refresh may or may not have run)
        decide(stub, a.segment)
        stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=a.segment), timeout=RPC_TIMEOUT)


def test_stored_reports_then_every_read_rpc_still_answers(stub, ledger):
    assert_unpoisoned(stub, ledger)  # after the refresh has taken in everything the test above stored


@given(hostile=messages(pb.RoundsAggregate.DESCRIPTOR), control_first=st.booleans())
@fuzz_settings(100)
def test_a_refused_report_stores_nothing(channel, stub, ledger, hostile: pb.RoundsAggregate, control_first: bool):
    """A valid control aggregate beside a hostile one: refused, the report stores neither (else both count)."""
    control = draft_aggregate(CONTROL)
    aggregates = [control, hostile] if control_first else [hostile, control]
    request = pb.ReportRoundsRequest(report_id=f"fuzz-{uuid.uuid4().hex}", worker_id="fuzz", aggregates=aggregates)
    code = call(channel, "ReportRounds", request.SerializeToString())
    assert_allowed(code, "ReportRounds")
    if code == grpc.StatusCode.OK:
        ledger.control_rounds += control.rounds
        ledger.segments.add(hostile.segment)


def test_refused_reports_left_the_control_totals_exact(stub, ledger):
    assert_unpoisoned(stub, ledger)


# --- ReloadPolicy with hostile files: refused (INVALID_ARGUMENT), or in force and decisions still answer ----


@pytest.fixture(scope="module")
def policy_path(daemon) -> Iterator[Path]:
    path = Path(daemon.config.policy_path)
    yield path
    path.write_text(DEFAULT_TEXT)


@given(data=st.one_of(mutated_default_documents(), policy_files))
@fuzz_settings(12)
def test_a_reloaded_policy_is_refused_or_decides(channel, stub, ledger, policy_path: Path, data: bytes):
    policy_path.write_bytes(data)
    code = call(channel, "ReloadPolicy", b"")
    assert code in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT), code.name
    plan = decide(stub, CONTROL)
    assert math.isfinite(plan.expected_speedup), plan
    stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=CONTROL), timeout=RPC_TIMEOUT)


def test_the_shipped_policy_reloads_after_the_fuzzing(stub, ledger, policy_path: Path):
    policy_path.write_text(DEFAULT_TEXT)
    stub.ReloadPolicy(pb.ReloadPolicyRequest(), timeout=RPC_TIMEOUT)
    assert_unpoisoned(stub, ledger)
