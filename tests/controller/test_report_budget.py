"""The per-peer budget of report work (controller/serving/report_budget.py): the token buckets and the peer
parsing (pure, on a fake clock), the config, and the real path: a daemon on a dual-stack loopback socket, clients
over gRPC from 127.0.0.1 and from ::1 (two peer hosts), and the worker's client library retrying a refused report.

The daemon's budget is 1,000 aggregates a second with a burst of 1,000 (the smallest allowed: one report at the size
bound), so a full report empties a bucket and the next aggregates wait about a millisecond each.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import grpc
import pytest
from pydantic import ValidationError

from controller.config import LearningConfig
from controller.server import ControllerDaemon
from controller.serving.report_budget import SEGMENT_COST, SHARED_PEER, ReportBudget, peer_host
from specd_api.checks import MAX_AGGREGATES
from specd_api.rounds import RoundRecord
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from specd_client import ClientConfig, ControllerClient
from tests.daemons import RPC_TIMEOUT, running_daemon
from tests.waiting import wait_until

RATE = 1000.0  # the test daemon's budget: aggregates a second per peer host
BURST = MAX_AGGREGATES
# Every filler report's segment: one name, so that fillers never fill the controller's cap on active segments (1,000;
# past it new segments count as _overflow, where a later test's segment would be lost if each filler had its own)
FILLER = "filler"


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


# --- the peer's host --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "peer, host",
    [
        ("ipv4:10.0.0.5:51234", "10.0.0.5"),
        ("ipv6:[::1]:5000", "::1"),
        ("ipv6:%5B::1%5D:5000", "::1"),  # the percent-encoded form newer gRPC versions write
        ("ipv6:[2001:DB8:0:0::1]:443", "2001:db8::/64"),  # canonical, by its /64: one host, one spelling, one bucket
        ("ipv6:[::ffff:10.0.0.5]:1", "10.0.0.5"),  # an IPv4 client of a dual-stack socket: the same host as over IPv4
        ("ipv6:[fe80::1%eth0]:9", "fe80::/64"),  # the zone names the interface, not the host
        ("unix:/run/specd.sock", SHARED_PEER),  # no address: every such client shares one bucket
        ("unix:", SHARED_PEER),
        ("", SHARED_PEER),
        ("ipv4:10.0.0.5", SHARED_PEER),  # no port: not the form gRPC writes
        ("ipv4:999.0.0.1:5", SHARED_PEER),
        ("ipv4:[::1]:5", SHARED_PEER),  # the scheme and the address disagree
        ("ipv6:10.0.0.5:5", SHARED_PEER),
        ("ipv6:[not-an-address]:5", SHARED_PEER),
        ("vsock:3:5000", SHARED_PEER),
    ],
)
def test_peer_host(peer, host):
    assert peer_host(peer) == host


# --- the token buckets ------------------------------------------------------------------------------------


def test_a_full_bucket_passes_its_burst_then_refuses_without_spending():
    clock = FakeClock()
    budget = ReportBudget(rate=100.0, burst=1000, clock=clock)
    assert budget.charge("a", 1000) is None  # a full bucket holds one report at the bound
    over = budget.charge("a", 50)
    assert over is not None
    assert (over.peer, over.cost, over.retry_after_seconds) == ("a", 50, pytest.approx(0.5))  # 50 at 100 a second
    clock.now += 0.4
    over = budget.charge("a", 50)  # the refusal spent nothing: 40 there now, 10 to go
    assert over is not None and over.retry_after_seconds == pytest.approx(0.1)
    clock.now += 0.1
    assert budget.charge("a", 50) is None  # exactly when it said
    assert budget.charge("a", 1) is not None


def test_a_report_costs_its_aggregates_and_the_segments_they_touch_at_most_the_bucket():
    budget = ReportBudget(rate=100.0, burst=5000)
    assert budget.cost_of(["a"] * 1000) == 1000
    assert budget.cost_of(["a", "b"] * 500) == 1000 + SEGMENT_COST
    spread = [f"s{i % 980}" for i in range(1000)]
    assert budget.cost_of(spread) == 1000 + SEGMENT_COST * 979
    assert ReportBudget(rate=100.0, burst=1000).cost_of(spread) == 1000  # never more than a full bucket holds
    assert budget.cost_of([]) == 0


def test_a_bucket_refills_at_the_rate_up_to_the_burst():
    clock = FakeClock()
    budget = ReportBudget(rate=100.0, burst=1000, clock=clock)
    assert budget.charge("a", 1000) is None
    clock.now += 3.0  # 300 back
    assert budget.charge("a", 301) is not None
    assert budget.charge("a", 300) is None
    clock.now += 3600.0  # an hour idle refills to the burst, no further
    assert budget.charge("a", 1000) is None
    assert budget.charge("a", 1) is not None


def test_a_clock_that_steps_back_refills_nothing():
    clock = FakeClock()
    budget = ReportBudget(rate=100.0, burst=1000, clock=clock)
    assert budget.charge("a", 1000) is None
    clock.now -= 50.0
    assert budget.charge("a", 1) is not None


def test_peers_have_buckets_of_their_own():
    budget = ReportBudget(rate=100.0, burst=1000, clock=FakeClock())
    assert budget.charge("a", 1000) is None
    assert budget.charge("a", 1) is not None
    assert budget.charge("b", 1000) is None  # a's spending left b's bucket full


def test_the_table_of_peers_is_bounded_least_recently_seen_out():
    clock = FakeClock()
    budget = ReportBudget(rate=100.0, burst=1000, max_peers=3, clock=clock)
    for peer in ("a", "b", "c"):
        assert budget.charge(peer, 1000) is None
    assert budget.charge("a", 1) is not None  # a is the most recently seen now
    for n in range(1000):  # spoofed peers
        budget.charge(f"spoofed-{n}", 1)
    assert budget.peers() == 3
    assert budget.charge("a", 1000) is None  # dropped, it came back with a full bucket (as a new peer does)


def test_a_refusal_is_logged_once_a_minute_per_peer():
    clock = FakeClock()
    budget = ReportBudget(rate=0.001, burst=1000, clock=clock)
    budget.charge("a", 1000)
    budget.charge("b", 1000)
    logs = []
    for _ in range(3):
        for peer in ("a", "b"):
            over = budget.charge(peer, 500)
            assert over is not None
            logs.append((peer, over.log))
        clock.now += 30.0
    assert logs == [("a", True), ("b", True), ("a", False), ("b", False), ("a", True), ("b", True)]


@pytest.mark.parametrize("rate, burst, max_peers", [(0, 1000, 10), (100, 0, 10), (100, 1000, 0)])
def test_a_budget_that_could_pass_nothing_is_refused(rate, burst, max_peers):
    with pytest.raises(ValueError, match="rate > 0"):
        ReportBudget(rate, burst, max_peers)


# --- the config -------------------------------------------------------------------------------------------


def test_the_default_budget_is_generous_for_honest_workers():
    learning = LearningConfig()
    budget = learning.report_budget()
    assert budget is not None
    # a worker's client sends at most 500 aggregates every 0.5 s: two such workers per host fit the default
    assert budget.rate >= 2 * 1000
    assert budget.burst >= MAX_AGGREGATES  # one report at the size bound always passes a full bucket


def test_a_rate_of_zero_turns_the_budget_off():
    assert LearningConfig(report_aggregates_per_second_per_peer=0).report_budget() is None


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"report_aggregates_per_second_per_peer": -1}, "report_aggregates_per_second_per_peer"),
        ({"report_aggregates_per_second_per_peer": float("inf")}, "report_aggregates_per_second_per_peer"),
        ({"report_aggregates_per_second_per_peer": float("nan")}, "report_aggregates_per_second_per_peer"),
        # a burst below one report at the size bound would refuse such a report forever, whatever the wait
        ({"report_aggregates_burst_per_peer": MAX_AGGREGATES - 1}, "report_aggregates_burst_per_peer"),
        ({"report_budget_max_peers": 0}, "report_budget_max_peers"),
    ],
)
def test_bad_budget_settings_are_refused_with_the_field_named(fields, named):
    with pytest.raises(ValidationError, match=named):
        LearningConfig(**fields)


# --- the real path: a daemon, clients from two loopback hosts ---------------------------------------------


@pytest.fixture(scope="module")
def daemon(embedded_redis_url, tmp_path_factory) -> Iterator[ControllerDaemon]:
    """A daemon on every loopback address, IPv4 and IPv6 (one dual-stack socket), with the test budget."""
    learning = {"report_aggregates_per_second_per_peer": RATE, "report_aggregates_burst_per_peer": BURST,
                "report_budget_hold_seconds": 0}  # fmt: skip  # refused once read: the hold is tested below
    folder = tmp_path_factory.mktemp("budget")
    with running_daemon(embedded_redis_url, folder, listen="[::]:0", learning=learning) as d:
        yield d


@pytest.fixture(scope="module")
def v4(daemon) -> Iterator[pb_grpc.ControllerStub]:
    """A client from 127.0.0.1."""
    with grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel:
        yield pb_grpc.ControllerStub(channel)


@pytest.fixture(scope="module")
def v6(daemon) -> Iterator[pb_grpc.ControllerStub]:
    """A client from ::1: another peer host."""
    with grpc.insecure_channel(f"[::1]:{daemon.port}") as channel:
        yield pb_grpc.ControllerStub(channel)


def aggregate(segment: str) -> pb.RoundsAggregate:
    """10 rounds of the draft model at K 2."""
    return pb.RoundsAggregate(
        segment=segment, drafter="draft", k=2, rounds=10, num_drafted=20, num_accepted=12,
        proposed_per_position=[10, 10], verified_per_position=[10, 8], accepted_per_position=[8, 4],
        tokens_emitted=22, draft_seconds=0.02, verify_seconds=0.1, batch_size=1,
        rounds_by_drafted=[0, 0, 10], verify_seconds_by_drafted=[0.0, 0.0, 0.1],
    )  # fmt: skip


def report(segment: str, n: int) -> pb.ReportRoundsRequest:
    return pb.ReportRoundsRequest(
        report_id=f"r-{uuid.uuid4().hex}", worker_id="budget-test", aggregates=[aggregate(segment)] * n
    )


def rounds(stub: pb_grpc.ControllerStub, segment: str) -> float:
    return stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=segment), timeout=RPC_TIMEOUT).rounds


def refused(daemon: ControllerDaemon) -> float:
    assert daemon.controller is not None
    value = daemon.controller.learner.registry.get_sample_value("specd_controller_reports_over_budget_total")
    return value or 0.0


def empty(stub: pb_grpc.ControllerStub) -> None:
    """Spend the peer's bucket: it waits a full second for the next report at the size bound, ~1 ms per aggregate."""
    for _ in range(5):  # a full bucket holds one of them, and a second only after a second of refill
        try:
            stub.ReportRounds(report(FILLER, MAX_AGGREGATES), timeout=RPC_TIMEOUT)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e
            return
    pytest.fail(f"5 reports of {MAX_AGGREGATES} aggregates back to back, none refused: no budget")


@contextmanager
def spending(stub: pb_grpc.ControllerStub, until: Callable[[], bool]) -> Iterator[None]:
    """Keep the peer's bucket below 50 aggregates (reports of 50, back to back) until ``until`` holds."""

    def spend() -> None:
        while not until():
            with contextlib.suppress(grpc.RpcError):
                stub.ReportRounds(report(FILLER, 50), timeout=RPC_TIMEOUT)

    thread = threading.Thread(target=spend, daemon=True)
    thread.start()
    try:
        yield
    finally:
        thread.join(10)


def retry_after(error: grpc.RpcError) -> float:
    found = re.search(r"fit in ([0-9.]+) s", error.details())
    assert found, error.details()
    return float(found.group(1))


def test_a_report_spread_over_segments_spends_more_of_the_budget(daemon, v4):
    """200 aggregates over 200 segments cost 200 + 4 x 199 = 996 of the 1,000 a full bucket holds: a report of 400
    right after is refused (the bucket refills 1,000 a second: the spread report's call would have to take 0.4 s to
    let it through). Charged by aggregates alone, 800 were left."""
    time.sleep(BURST / RATE)  # a full bucket
    spread = pb.ReportRoundsRequest(report_id=f"r-{uuid.uuid4().hex}", worker_id="budget-test",
                                    aggregates=[aggregate(f"spread-{i}") for i in range(200)])  # fmt: skip
    v4.ReportRounds(spread, timeout=RPC_TIMEOUT)
    with pytest.raises(grpc.RpcError) as caught:
        v4.ReportRounds(report(FILLER, 400), timeout=RPC_TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "400 aggregates over 1 segments" in caught.value.details()


def test_a_report_over_budget_is_refused_stores_nothing_and_counts_once_when_retried(daemon, v4, v6):
    segment, sentinel = f"over-{uuid.uuid4().hex[:8]}", f"sentinel-{uuid.uuid4().hex[:8]}"
    before = refused(daemon)
    empty(v4)
    over = report(segment, 300)  # 0.3 s of the budget
    with pytest.raises(grpc.RpcError) as caught:
        v4.ReportRounds(over, timeout=RPC_TIMEOUT)
    error = caught.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for said in ("127.0.0.1", f"{RATE:g} aggregates a second", f"bursts of {BURST}", "retry", "nothing of it"):
        assert said in error.details()
    assert 0 < retry_after(error) <= 0.3
    assert refused(daemon) >= before + 2  # the filler refused, and this one

    # ::1 is another host: its full bucket takes a report at the bound while 127.0.0.1's is empty
    v6.ReportRounds(report(sentinel, MAX_AGGREGATES), timeout=RPC_TIMEOUT)
    assert wait_until(lambda: rounds(v6, sentinel) == pytest.approx(10 * MAX_AGGREGATES))
    assert rounds(v6, segment) == 0  # a refresh ran after the refusal: nothing of the refused report was stored

    time.sleep(retry_after(error))
    first = v4.ReportRounds(over, timeout=RPC_TIMEOUT)  # the same report, its same id, once the bucket holds it
    assert (first.rounds_accepted, first.duplicate) == (3000, False)
    time.sleep(0.35)
    again = v4.ReportRounds(over, timeout=RPC_TIMEOUT)  # an ordinary retry of a stored report: a duplicate
    assert again.duplicate
    assert wait_until(lambda: rounds(v4, segment) == pytest.approx(3000))
    time.sleep(0.3)  # several refreshes
    assert rounds(v4, segment) == pytest.approx(3000)  # exactly once


def test_a_report_past_the_size_bound_is_invalid_and_spends_no_budget(v6):
    time.sleep(BURST / RATE)  # a full bucket
    with pytest.raises(grpc.RpcError) as caught:
        v6.ReportRounds(report("oversize", MAX_AGGREGATES + 1), timeout=RPC_TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert str(MAX_AGGREGATES) in caught.value.details()
    v6.ReportRounds(report(FILLER, MAX_AGGREGATES), timeout=RPC_TIMEOUT)  # the bucket is still full


def test_the_workers_client_keeps_a_refused_report_and_delivers_it_once(daemon, v4):
    # The client's report is at the size bound (the burst): it fits only in a full bucket, one whole second after
    # the spender's last report passed. (A smaller report, say 400 aggregates, could pass on its first send: on a slow
    # machine the spender, in this process beside the daemon, can stall long enough for the bucket to refill that far.)
    segment = f"worker-{uuid.uuid4().hex[:8]}"
    config = ClientConfig(
        address=f"127.0.0.1:{daemon.port}", worker_id="budget-worker", report_interval_s=0.05,
        retry_backoff_s=(0.05, 0.2), reconnect_backoff_s=(0.05, 0.2), max_aggregates_per_report=MAX_AGGREGATES,
    )  # fmt: skip
    client = ControllerClient(config)
    round_ = RoundRecord("draft", 2, 2, 1, 2, 0.001, 0.01, 1)
    for n in range(MAX_AGGREGATES):  # one report of MAX_AGGREGATES aggregates, 10 segments of 100 requests each
        client.report(segment=f"{segment}-{n % 10}", rounds=[round_], temperature=0.0, prompt_tokens=10,
                      self_repetition=0.0)  # fmt: skip
    before = refused(daemon)
    try:
        with spending(v4, until=lambda: client.stats().send_failures > 0):  # its first sends find the bucket empty
            empty(v4)
            client.start()
            assert wait_until(lambda: client.stats().send_failures > 0)
        assert wait_until(lambda: client.stats().aggregates_sent == MAX_AGGREGATES, timeout=10)
        stats = client.stats()
    finally:
        client.close(flush_timeout_s=1.0)
    assert refused(daemon) >= before + 2  # the filler, and the client's report at least once
    assert stats.send_failures >= 1
    assert (stats.buffered, stats.aggregates_dropped, stats.aggregates_rejected) == (0, 0, 0)
    # delivered once: every segment's rounds, not twice as many. Waited for whole, not for one segment: the refresh
    # that shows one segment's part may have read another's just before it landed (the last segment shown, the
    # first still 0), and the next one shows it
    once = [pytest.approx(MAX_AGGREGATES // 10)] * 10
    wait_until(lambda: [rounds(v4, f"{segment}-{n}") for n in range(10)] == once, timeout=10)
    assert [rounds(v4, f"{segment}-{n}") for n in range(10)] == once


def test_a_client_reporting_back_to_back_is_held_to_its_budget_before_its_report_is_read(
    embedded_redis_url, tmp_path
) -> None:
    """With the hold (the default), a client over its budget waits, on the event loop, until its bucket holds what
    its last report cost, and only then is its report read: it is paced to its budget, not refused after parsing
    (a refusal once read costs the controller ~4 ms of a report at the bound, and an attacker sends 130 a second)."""
    learning = {"report_aggregates_per_second_per_peer": RATE, "report_aggregates_burst_per_peer": BURST}
    with (
        running_daemon(embedded_redis_url, tmp_path, listen="127.0.0.1:0", learning=learning) as daemon,
        grpc.insecure_channel(f"127.0.0.1:{daemon.port}") as channel,
    ):
        stub = pb_grpc.ControllerStub(channel)
        segment = f"held-{uuid.uuid4().hex[:8]}"
        start = time.perf_counter()
        answers = [stub.ReportRounds(report(segment, 500), timeout=RPC_TIMEOUT) for _ in range(4)]
        elapsed = time.perf_counter() - start
        assert all(a.rounds_accepted == 5000 and not a.duplicate for a in answers), "none refused"
        assert refused(daemon) == 0
        # the burst takes the first two; each further report of 500 waits 0.5 s of refill at 1,000 a second
        assert elapsed >= 0.9, f"4 reports of 500 aggregates in {elapsed:.2f} s: not held to 1,000 a second"
        assert wait_until(lambda: rounds(stub, segment) == pytest.approx(4 * 5000))


def test_a_hold_is_the_refill_a_peers_last_report_needs_and_no_longer_than_its_bound() -> None:
    clock = [0.0]
    budget = ReportBudget(1000.0, 1000.0, clock=lambda: clock[0], max_hold_seconds=0.8)
    assert budget.hold_seconds("10.0.0.1") == 0.0, "never seen: nothing to hold"
    assert budget.charge("10.0.0.1", 1000) is None
    assert budget.hold_seconds("10.0.0.1") == pytest.approx(0.8), "a second of refill needed, held 0.8 s at most"
    clock[0] = 0.5
    assert budget.hold_seconds("10.0.0.1") == pytest.approx(0.5)
    assert budget.hold_seconds("10.0.0.2") == 0.0, "another host"
    assert budget.charge("10.0.0.1", 10) is None and budget.hold_seconds("10.0.0.1") == 0.0, "its last report: 10"
