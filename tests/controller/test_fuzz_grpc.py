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
from typing import Any

import grpc
import pytest
from google.protobuf.message_factory import GetMessageClass
from hypothesis import event, example, given
from hypothesis import strategies as st

from controller.server import ControllerDaemon
from specd_api.checks import MAX_AGGREGATES, MAX_K
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.controller.proto_strategies import SEGMENT_CHARS, field_values, messages, wire, with_field
from tests.controller.test_service import decide, draft_aggregate, per_drafted, report
from tests.controller.yaml_strategies import DEFAULT_TEXT, mutated_default_documents, policy_files
from tests.daemons import RPC_TIMEOUT, connected, running_daemon
from tests.fuzzing import fuzz_settings

SERVICE = pb.DESCRIPTOR.services_by_name["Controller"]
METHODS = {m.name: m for m in SERVICE.methods}
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
CONTROL = "fuzz-control"  # a segment no strategy can name (its letters are not SEGMENT_CHARS)
assert not set(CONTROL) <= set(SEGMENT_CHARS)
WAIT_FOR_REFRESH = 3.0  # the daemon refreshes every 0.1 s


# Messages without fields have little to vary; ReloadPolicy re-reads the file (0.25 s to see it stable).
WITH_FIELDS = sorted(name for name, m in METHODS.items() if m.input_type.fields)
WITHOUT_FIELDS = sorted(name for name, m in METHODS.items() if not m.input_type.fields and name != "ReloadPolicy")


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


def call(channel: grpc.Channel, method: str, request: bytes, record: bool = True) -> grpc.StatusCode:
    """Send ``request`` as the serialized request of ``method``; its status (the response bytes are not parsed).
    ``record``: count the status among the test's hypothesis events (--hypothesis-show-statistics)."""
    return call_with_details(channel, method, request, record)[0]


def call_with_details(
    channel: grpc.Channel, method: str, request: bytes, record: bool = True
) -> tuple[grpc.StatusCode, str]:
    path = f"/{SERVICE.full_name}/{method}"  # no serializers: bytes in, bytes out
    try:
        if METHODS[method].server_streaming:  # WatchDecisions: its first message (all the tables) or its refusal
            stream = channel.unary_stream(path)(request, timeout=RPC_TIMEOUT)
            next(stream)
            stream.cancel()
        else:
            channel.unary_unary(path)(request, timeout=RPC_TIMEOUT)
        code, details = grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        code, details = e.code(), e.details() or ""
    if record:
        event(f"{method}: {code.name}")
    return code, details


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


def send_message(channel: grpc.Channel, method: str, data: st.DataObject) -> None:
    request = data.draw(messages(METHODS[method].input_type), label="request")
    assert_allowed(call(channel, method, request.SerializeToString()), method)


def send_bytes(channel: grpc.Channel, method: str, data: st.DataObject) -> None:
    request = data.draw(st.one_of(wire(METHODS[method].input_type), st.binary(max_size=64)), label="request")
    assert_allowed(call(channel, method, request), method)


@pytest.mark.parametrize("method", WITH_FIELDS)
@given(data=st.data())
@fuzz_settings(100)
def test_any_message_is_answered_ok_or_invalid_argument(channel, ledger, method: str, data: st.DataObject):
    send_message(channel, method, data)


# A valid request per RPC with fields: the one-field test replaces one of its fields (an RPC added later without
# one here gets an empty base, whose other fields are mostly invalid already).
BASES = {
    "Decide": pb.DecideRequest(
        segment="fuzz-base", batch_size=1, drafters=["draft", "prompt_lookup"], max_new_tokens=64, prompt_tokens=10,
        sampling=pb.SamplingParams(temperature=0.7, top_p=0.9, top_k=40),
        prompt_features=pb.PromptFeatures(self_repetition=0.2),
    ),
    "ReportRounds": report(draft_aggregate("fuzz-base"), report_id="fuzz-base"),
    "GetSegmentStats": pb.GetSegmentStatsRequest(segment="fuzz-base"),
}  # fmt: skip


@pytest.mark.parametrize("method", WITH_FIELDS)
@given(data=st.data())
@fuzz_settings(100)
def test_one_hostile_field_is_refused_naming_it(channel, ledger, method: str, data: st.DataObject):
    """A valid request with one field replaced: answered, or refused with a message that names that field."""
    descriptor = METHODS[method].input_type
    base: Any = BASES.get(method) or GetMessageClass(descriptor)()
    assert base.DESCRIPTOR is descriptor
    values = field_values(descriptor)
    name = data.draw(st.sampled_from(sorted(values)), label="field")
    request = with_field(base, name, data.draw(values[name], label="value"))
    code, details = call_with_details(channel, method, request.SerializeToString())
    assert_allowed(code, method)
    if code == grpc.StatusCode.INVALID_ARGUMENT and method in BASES:
        assert name in details, f"{method}: {name} refused without naming it: {details!r}"
    if code == grpc.StatusCode.OK and method == "ReportRounds":
        ledger.segments.update(a.segment for a in request.aggregates)


@pytest.mark.parametrize("method", WITHOUT_FIELDS)
@given(data=st.data())
@fuzz_settings(10)
def test_any_message_without_fields_is_answered_ok(channel, ledger, method: str, data: st.DataObject):
    send_message(channel, method, data)


@pytest.mark.parametrize("method", WITH_FIELDS)
@given(data=st.data())
@fuzz_settings(100)
def test_any_bytes_are_answered_ok_or_invalid_argument(channel, ledger, method: str, data: st.DataObject):
    send_bytes(channel, method, data)


@pytest.mark.parametrize("method", [*WITHOUT_FIELDS, "ReloadPolicy"])
@given(data=st.data())
@fuzz_settings(10)
def test_any_bytes_to_a_message_without_fields(channel, ledger, method: str, data: st.DataObject):
    send_bytes(channel, method, data)


def unparsable(method: str) -> list[tuple[str, bytes]]:
    """Bytes no request of ``method`` parses from: a cut tag, a length past the end, a string field not UTF-8."""
    found = [("cut-tag", b"\xff"), ("length-past-the-end", b"\x0a\x05")]
    strings = [f for f in METHODS[method].input_type.fields if f.type == f.TYPE_STRING]
    if strings:
        found.append((f"{strings[0].name}-not-utf8", bytes([strings[0].number << 3 | 2, 2, 0xFF, 0xFE])))
    return found


@pytest.mark.parametrize(
    ("method", "request_bytes"),
    [
        pytest.param(method, data, id=f"{method}-{what}")
        for method in sorted(METHODS)
        for what, data in unparsable(method)
    ],
)
def test_bytes_that_do_not_parse_are_invalid_argument(channel, method: str, request_bytes: bytes):
    """gRPC answers a request that does not parse with INTERNAL (UNKNOWN on grpc.aio) unless the server parses it
    itself; serving/unparsable.py does, and maps it to INVALID_ARGUMENT."""
    assert call(channel, method, request_bytes, record=False) == grpc.StatusCode.INVALID_ARGUMENT


def giant(method: str) -> list[bytes]:
    """Repeated fields at and past their bounds, and a message past gRPC's 4 MB limit."""
    if method == "Decide":
        return [
            pb.DecideRequest(segment="s", batch_size=1, drafters=["draft"] * 100_000).SerializeToString(),
            pb.DecideRequest(segment="s", batch_size=1, drafters=["prompt_lookup"] * 400_000).SerializeToString(),
        ]
    empty = pb.RoundsAggregate(segment="s", drafter="none", batch_size=1)
    return [
        pb.ReportRoundsRequest(report_id="r", aggregates=[empty] * (MAX_AGGREGATES + 1)).SerializeToString(),
        pb.ReportRoundsRequest(
            report_id="r", aggregates=[draft_aggregate("s", proposed_per_position=[10] * 100_000)]
        ).SerializeToString(),
    ]


@pytest.mark.parametrize("method", ["Decide", "ReportRounds"])
def test_giant_repeated_fields(channel, method: str):
    for request in giant(method):
        assert_allowed(call(channel, method, request, record=False), method)


def test_after_the_fuzzing_every_rpc_still_answers(stub, ledger):
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
    proposed: list[int] = []
    verified: list[int] = []
    accepted: list[int] = []
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
        if rounds:  # served rounds: the per-n timing table their positions imply
            table = per_drafted(rounds, proposed, a.verify_seconds)
            a.rounds_by_drafted.extend(table["rounds_by_drafted"])
            a.verify_seconds_by_drafted.extend(table["verify_seconds_by_drafted"])
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


INFINITE_POLICY = (
    b"defaults:\n  prior_strength: .inf\n  plan_prior_rounds: .inf\n  prefill_cost_per_token: .inf\n"
    b"  min_speedup: .inf\n  max_batch_size: 9223372036854775807\n  drafters: {draft: {cost_ratio: .inf}}\n"
)


@given(data=st.one_of(mutated_default_documents(), policy_files))
@example(data=INFINITE_POLICY)
@example(data=INFINITE_POLICY.replace(b".inf", b"1e308").replace(b"min_speedup: 1e308", b"min_speedup: 1.0"))
@example(data=b"defaults:\n  min_speedup: 1.0\n  prior_strength: 1e-300\n  drafters: {draft: {cost_ratio: 1e-300}}\n")
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
