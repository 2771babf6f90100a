"""Reports validated and stored in a child process (serving/report_process.py), over gRPC against a real
daemon and its real Redis: the daemon's learner never sees a report the child stored; an invalid report is refused
with its reason; a retry is a duplicate; a report that must queue behind the journal's backlog, or one Redis refused
in the child, is the daemon's (journaled); a child that dies is replaced, and no report is lost meanwhile. And the
child stores what the daemon would have: the same fields, its realised speedups read at the daemon's step times."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import grpc
import pytest
import redis

from controller.server import ControllerDaemon
from controller.serving import report_process, validation
from controller.serving.report_budget import ReportBudget
from controller.serving.report_head import ReceivedReport
from controller.serving.report_process import Invalid, ReportProcess, Stored, StoreSpec, report_steps
from controller.storage.journal import Journal
from controller.storage.store import StoreConfig, TelemetryStore
from specd_api.checks import REPORT_HELD
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.controller.test_client import REPORT_ARGS, REQUEST_ROUNDS, started
from tests.controller.test_client import config as client_config
from tests.controller.test_service import draft_aggregate, report
from tests.daemons import connected, daemon_config, running, running_daemon

UNREACHABLE_URL = "redis://127.0.0.1:1/0"  # nothing listens on port 1


def wait_for(what: str, ready: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def daemon(embedded_redis_url, tmp_path_factory) -> Iterator[ControllerDaemon]:
    with running_daemon(embedded_redis_url, tmp_path_factory.mktemp("reports")) as d:
        assert d.reports is not None, "the report process is on by default"
        wait_for("the report process to answer", lambda: d.reports is not None and d.reports.ready)
        yield d


@pytest.fixture
def stub(daemon) -> Iterator[pb_grpc.ControllerStub]:
    with connected(daemon) as channel:
        yield pb_grpc.ControllerStub(channel)


@pytest.fixture
def in_daemon(daemon, monkeypatch) -> list[str]:
    """The report ids the daemon's own learner stored or journaled (none, while the child stores them)."""
    learner = daemon.controller.learner
    done: list[str] = []
    real = learner.report

    def counted(report_id, aggregates):
        done.append(report_id)
        return real(report_id, aggregates)

    monkeypatch.setattr(learner, "report", counted)
    return done


def test_the_child_stores_a_report_and_a_retry_of_it_is_a_duplicate(daemon, stub, in_daemon) -> None:
    request = report(draft_aggregate("child-stored"), draft_aggregate("child-stored", batch_size=4))
    first = stub.ReportRounds(request, timeout=10)
    assert (first.rounds_accepted, first.duplicate, first.journaled) == (20, False, False)
    again = stub.ReportRounds(request, timeout=10)  # the worker's retry: same id
    assert (again.rounds_accepted, again.duplicate) == (0, True)
    assert in_daemon == [], "the daemon's learner did the report itself"
    child = daemon.reports._pool.submit(report_process._started).result(timeout=10)[0]
    assert os.getpriority(os.PRIO_PROCESS, child) == os.getpriority(os.PRIO_PROCESS, 0) + report_process.NICE
    wait_for("the refresh to show it", lambda: daemon.controller.learner.segment_counts("child-stored").rounds == 20)


def test_an_invalid_report_is_refused_by_the_child_with_its_reason(daemon, stub, in_daemon) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        stub.ReportRounds(report(draft_aggregate("child-invalid"), draft_aggregate("child-invalid", k=65)), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "aggregates[1]" in refused.value.details() and "k must be" in refused.value.details()
    assert in_daemon == [] and not daemon.controller.learner.counted("child-invalid")


def test_the_daemon_parses_a_reports_head_only_and_hands_the_child_its_bytes(daemon, stub, in_daemon,
                                                                             monkeypatch) -> None:  # fmt: skip
    """The daemon reads the report id, and each aggregate's segment and batch size (serving/report_head.py); the
    child gets the bytes as they came and parses them whole (a parse and a serialization of 1 MiB each, in the
    daemon's interpreter, before)."""
    whole: list[bytes] = []
    parse_whole = ReceivedReport.message
    monkeypatch.setattr(ReceivedReport, "message", lambda self: whole.append(self.data) or parse_whole(self))
    handed: list[bytes] = []
    ingest = daemon.reports.ingest

    def spied(data, steps, holder):
        handed.append(data)
        return ingest(data, steps, holder)

    monkeypatch.setattr(daemon.reports, "ingest", spied)
    request = report(draft_aggregate("head-only"), draft_aggregate("head-only", batch_size=3))
    assert stub.ReportRounds(request, timeout=10).rounds_accepted == 20
    assert handed == [request.SerializeToString()] and whole == [] and in_daemon == []
    monkeypatch.setattr(Journal, "__len__", lambda self: 1)  # a backlog: the daemon's report, parsed whole there
    later = report(draft_aggregate("head-only"))
    assert stub.ReportRounds(later, timeout=10).rounds_accepted == 10
    assert whole == [later.SerializeToString()] and in_daemon == [later.report_id] and len(handed) == 1


def _not_utf8_drafter(request: pb.ReportRoundsRequest) -> bytes:
    """``request``'s bytes with each drafter name ("draft", field 2 of an aggregate) made bytes that are not UTF-8:
    the head (report id, segments, batch sizes) still parses, the whole request does not."""
    data = request.SerializeToString()
    assert data.count(b"\x12\x05draft") == len(request.aggregates)
    return data.replace(b"\x12\x05draft", b"\x12\x05dr\xffft")


def test_a_report_whose_rest_does_not_parse_is_invalid_argument_in_the_child_and_in_the_daemon(
    daemon, in_daemon, monkeypatch
) -> None:
    data = _not_utf8_drafter(report(draft_aggregate("rest-unparsable")))
    answers = []
    with connected(daemon) as channel:
        raw = channel.unary_unary("/specd.v1.Controller/ReportRounds")  # bytes in, bytes out
        for backlog in (0, 1):  # the child's report, then (behind a backlog) the daemon's
            monkeypatch.setattr(Journal, "__len__", lambda self, n=backlog: n)
            with pytest.raises(grpc.RpcError) as refused:
                raw(data, timeout=10)
            answers.append((refused.value.code(), refused.value.details()))
    assert answers[0] == answers[1], "the child and the daemon say it differently"
    code, details = answers[0]
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("/specd.v1.Controller/ReportRounds: the request does not parse") and "UTF-8" in details
    assert in_daemon == [] and not daemon.controller.learner.counted("rest-unparsable")


def test_a_reports_head_reads_the_requests_own_fields() -> None:
    request = report(draft_aggregate("head-a", batch_size=3), draft_aggregate("head-b"), report_id="r-head")
    head = ReceivedReport.of(request).head
    assert head.report_id == "r-head"
    assert [(a.segment, a.batch_size) for a in head.aggregates] == [("head-a", 3), ("head-b", 1)]
    assert ReceivedReport.of(request).message() == request
    kept = ("segment", "batch_size", "temperature", "start_up_timings")
    for message, names in ((head, ("report_id", "aggregates")), (head.aggregates[0], kept)):
        full = pb.DESCRIPTOR.message_types_by_name[message.DESCRIPTOR.name]
        assert [(f.name, f.number, f.type, f.is_repeated, f.is_packed) for f in message.DESCRIPTOR.fields] == [
            (f.name, f.number, f.type, f.is_repeated, f.is_packed) for f in full.fields if f.name in names
        ]


def test_a_report_behind_the_journals_backlog_is_the_daemons(daemon, stub, in_daemon, monkeypatch) -> None:
    monkeypatch.setattr(Journal, "__len__", lambda self: 1)  # a backlog: reports queue behind it, in order
    request = report(draft_aggregate("behind-backlog"))
    assert stub.ReportRounds(request, timeout=10).rounds_accepted == 10
    assert in_daemon == [request.report_id]


def test_a_child_that_dies_is_replaced_and_no_report_is_lost(daemon, stub, in_daemon) -> None:
    reports = daemon.reports
    pid = reports._pool.submit(report_process._started).result(timeout=10)[0]
    restarts = reports.restarts
    os.kill(pid, signal.SIGKILL)
    wait_for("the child to be gone", lambda: _gone(pid))
    meanwhile = report(draft_aggregate("child-died"))
    assert stub.ReportRounds(meanwhile, timeout=10).rounds_accepted == 10  # the daemon's, while it is replaced
    assert in_daemon == [meanwhile.report_id]
    wait_for("another child", lambda: reports.ready and reports.restarts == restarts + 1)
    assert reports._pool.submit(report_process._started).result(timeout=10)[0] != pid
    after = report(draft_aggregate("child-died"))
    assert stub.ReportRounds(after, timeout=10).rounds_accepted == 10
    assert in_daemon == [meanwhile.report_id], "the new child stores the reports again"
    wait_for("both reports counted", lambda: daemon.controller.learner.segment_counts("child-died").rounds == 20)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie its parent has not reaped yet is gone too
        return f.read().split(")")[-1].split()[0] == "Z"


def test_a_report_redis_refused_in_the_child_is_journaled_by_the_daemon(tmp_path, monkeypatch) -> None:
    """Redis fails in the child while the daemon's last refresh still found it (not stale): the daemon tries the
    report itself and journals it. (While stale, the child is not asked at all.)"""
    with running(daemon_config(UNREACHABLE_URL, tmp_path / "down", redis_timeout_seconds=0.2)) as daemon:
        assert daemon.reports is not None
        wait_for("the report process to answer", lambda: daemon.reports is not None and daemon.reports.ready)
        learner = daemon.controller.learner
        asked: list[str] = []
        ingest = daemon.reports.ingest

        def counted(data, steps, holder):
            asked.append(pb.ReportRoundsRequest.FromString(data).report_id)
            return ingest(data, steps, holder)

        monkeypatch.setattr(daemon.reports, "ingest", counted)
        with connected(daemon) as channel:
            stub = pb_grpc.ControllerStub(channel)
            answer = stub.ReportRounds(report(draft_aggregate("redis-down")), timeout=10)
            assert learner.stale and asked == [], "asked the child while Redis is known to be down"
            assert (answer.rounds_accepted, answer.journaled) == (10, True)
            learner.journal.replay(lambda *report: None)  # the backlog gone: the next report may go to the child
            monkeypatch.setattr(type(learner), "stale", property(lambda self: False))
            request = report(draft_aggregate("redis-down"))
            answer = stub.ReportRounds(request, timeout=10)
        assert asked == [request.report_id], "the child was not asked"
        assert (answer.rounds_accepted, answer.journaled) == (10, True)
        assert len(learner.journal) == 1


def test_a_report_the_child_holds_past_its_answer_time_stays_the_childs(daemon, stub, in_daemon, monkeypatch) -> None:
    """A stopped child (or one queued behind heavy reports): past ANSWER_SECONDS the daemon answers UNAVAILABLE and
    does none of the report's work; the retry (same id, same host) waits on the same work, is not charged to the
    budget again, and the report is stored once, by the child."""
    monkeypatch.setattr(report_process, "ANSWER_SECONDS", 0.5)
    pid = daemon.reports._pool.submit(report_process._started).result(timeout=10)[0]
    charged: list[int] = []
    charge = ReportBudget.charge
    monkeypatch.setattr(
        ReportBudget, "charge", lambda self, host, cost: charged.append(cost) or charge(self, host, cost)
    )
    submitted: list[object] = []
    submit = daemon.reports._submitted
    monkeypatch.setattr(daemon.reports, "_submitted", lambda *a: submitted.append(a[1]) or submit(*a))
    os.kill(pid, signal.SIGSTOP)
    request = report(draft_aggregate("child-stopped"))
    try:
        for _ in range(2):  # the first call, and a retry while the child is still stopped
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as held:
                stub.ReportRounds(request, timeout=10)
            assert held.value.code() == grpc.StatusCode.UNAVAILABLE and "retry" in held.value.details()
            assert (REPORT_HELD, "1") in held.value.trailing_metadata()  # busy, told apart from down
            assert time.monotonic() - started < 5
    finally:
        os.kill(pid, signal.SIGCONT)
    answer = stub.ReportRounds(request, timeout=10)  # the retry: the same work's answer, not a duplicate's
    assert (answer.rounds_accepted, answer.duplicate) == (10, False)
    assert in_daemon == [], "the daemon did a report the child held"
    assert submitted == [report_process._ingest], "the retries sent the report to the child again"
    assert len(charged) == 1, "a retry of a held report was charged again"
    assert daemon.reports._pool.submit(report_process._started).result(timeout=10)[0] == pid  # the same child
    learner = daemon.controller.learner
    wait_for("the report counted", lambda: learner.segment_counts("child-stopped").rounds == 10)


def test_the_client_counts_a_held_report_apart_from_a_failed_send(daemon, in_daemon, monkeypatch) -> None:
    """specd_client against a daemon whose child is stopped: each attempt answered "held" is counted in
    reports_held, not send_failures (a busy controller is not a down one), and the report arrives once the child
    resumes."""
    monkeypatch.setattr(report_process, "ANSWER_SECONDS", 0.3)
    pid = daemon.reports._pool.submit(report_process._started).result(timeout=10)[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        with started(client_config(daemon.address)) as client:
            client.report(segment="held-counted", rounds=REQUEST_ROUNDS, **REPORT_ARGS)
            wait_for("two held attempts", lambda: client.stats().reports_held >= 2)
            os.kill(pid, signal.SIGCONT)
            wait_for("the report acknowledged", lambda: client.stats().reports_sent == 1)
            stats = client.stats()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert stats.send_failures == 0 and stats.reports_held >= 2, stats
    assert (stats.aggregates_sent, stats.aggregates_dropped, stats.buffered) == (3, 0, 0), stats
    assert in_daemon == [], "the daemon did a report the child held"


def test_a_child_that_answers_nothing_for_its_stuck_time_is_replaced(daemon, stub, in_daemon, monkeypatch) -> None:
    """A child stopped for good: once it has had work and answered nothing for STUCK_SECONDS, the next call past its
    answer time kills it, and a new child stores the report; it is counted once."""
    monkeypatch.setattr(report_process, "ANSWER_SECONDS", 0.5)
    monkeypatch.setattr(report_process, "STUCK_SECONDS", 1.5)
    reports = daemon.reports
    pid = reports._pool.submit(report_process._started).result(timeout=10)[0]
    restarts = reports.restarts
    os.kill(pid, signal.SIGSTOP)
    request = report(draft_aggregate("child-stuck"))
    deadline = time.monotonic() + 30
    try:
        while True:
            assert time.monotonic() < deadline, "the stuck child was never replaced"
            try:
                answer = stub.ReportRounds(request, timeout=10)
                break
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                time.sleep(0.2)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert answer.rounds_accepted == 10
    assert reports.restarts == restarts + 1
    wait_for("a new child", lambda: reports.ready)
    assert reports._pool.submit(report_process._started).result(timeout=10)[0] != pid
    learner = daemon.controller.learner
    wait_for("the report counted", lambda: learner.segment_counts("child-stuck").rounds == 10)
    time.sleep(0.5)
    assert learner.segment_counts("child-stuck").rounds == 10, "counted twice"


def test_a_child_that_could_not_start_is_tried_again(embedded_redis_url, caplog) -> None:
    good = StoreSpec(embedded_redis_url, 0.5, None, StoreConfig(prefix="restart-test"))
    reports = ReportProcess(replace(good, url="notascheme://nowhere"))
    try:
        reports.start()  # its store cannot be built: the child fails to start
        wait_for("the failed start", lambda: reports._retry_seconds >= report_process.FIRST_RETRY_SECONDS)
        assert not reports.ready and "did not start" in caplog.text
        reports.spec = good  # whatever stopped it has passed
        wait_for("the child, on a later try", lambda: reports.ready)
        request = report(draft_aggregate("restarted"))
        holder = ("127.0.0.1", request.report_id)
        assert reports.ingest(request.SerializeToString(), {}, holder) == Stored(request.report_id, 10, False)
    finally:
        reports.close()


def test_the_child_stores_what_the_daemon_would_have(redis_client: redis.Redis, prefix: str, monkeypatch) -> None:
    """The same report, stored by the daemon's store with its step times and by the child's function with the
    step table ``report_steps`` makes: the same Redis fields, realised speedups (``cal|``) included."""
    now = 1_000_000.0
    request = report(
        draft_aggregate("same-a", expected_speedup=1.5, request_tokens_emitted=40, request_seconds=0.5),
        draft_aggregate("same-b", batch_size=3, expected_speedup=1.2, request_tokens_emitted=30, request_seconds=0.4),
        report_id="same-report",
    )
    steps = {("same-a", 1): 0.010, ("same-b", 3): 0.020}

    def step_seconds(segment: str, batch_size: int) -> float:
        return steps[(segment, batch_size)]

    daemons = TelemetryStore(redis_client, StoreConfig(prefix=f"{prefix}-daemon"), lambda: now)
    report_id, aggregates = validation.report(request)
    daemons.ingest(report_id, aggregates, step_seconds)
    monkeypatch.setattr(report_process, "_store", TelemetryStore(redis_client, StoreConfig(prefix=f"{prefix}-child"),
                                                                 lambda: now))  # fmt: skip
    table = report_steps(request, step_seconds)
    assert table == {("same-a", 1): 0.010, ("same-b", 4): 0.020}  # batch 3 is in bucket 4
    assert report_process._ingest(request.SerializeToString(), table) == Stored("same-report", 20, False)
    assert report_process._ingest(request.SerializeToString(), table) == Stored("same-report", 0, True)
    stored = {}
    for side in ("daemon", "child"):
        keys = sorted(redis_client.scan_iter(f"{prefix}-{side}:*"))
        stored[side] = {  # a store's change marks carry its own epoch: not counts
            k.split(":", 1)[1]: _value(redis_client, k) for k in keys if ":report" not in k and "change" not in k
        }
    assert stored["child"] == stored["daemon"] and stored["daemon"]
    assert any("cal|" in field for value in stored["daemon"].values() if isinstance(value, dict) for field in value)
    bad = pb.ReportRoundsRequest(report_id="bad id!", aggregates=[draft_aggregate("same-a")])
    assert report_process._ingest(bad.SerializeToString(), {}) == Invalid(
        "report_id must be 1..128 characters of [A-Za-z0-9_.:-]"
    )
    for side in ("daemon", "child"):
        keys = list(redis_client.scan_iter(f"{prefix}-{side}:*"))
        if keys:
            redis_client.delete(*keys)


def _value(client: redis.Redis, key: str) -> object:
    kind = client.type(key)
    if kind == "hash":
        return client.hgetall(key)
    if kind == "zset":
        return [member for member, _ in client.zrange(key, 0, -1, withscores=True)]
    if kind == "list":
        return client.lrange(key, 0, -1)
    if kind == "string":
        return client.get(key)
    return kind


def test_a_report_process_the_os_will_not_nice_runs_on_and_says_why(monkeypatch) -> None:
    def refused(increment: int) -> int:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "nice", refused)
    assert report_process.lower_priority(10) == "not niced: [Errno 1] Operation not permitted"


def test_the_priors_refits_run_in_the_niced_child_not_beside_the_decisions(embedded_redis_url, tmp_path) -> None:
    # Fitting the prior is seconds of scikit-learn: in the daemon, at its priority, it made a request decoding beside
    # it run at a quarter of its speed. Once the child is up, every refit runs there, niced, never in the daemon.
    learning = {"prior_retrain_seconds": 0.2}
    with running_daemon(embedded_redis_url, tmp_path, learning=learning) as d:
        assert d.reports is not None and d.controller is not None
        wait_for("the report process to answer", lambda: d.reports is not None and d.reports.ready)
        learner = d.controller.learner
        in_daemon: list[float] = []
        real = learner._refit_prior

        def counted() -> None:
            in_daemon.append(time.monotonic())
            real()

        learner._refit_prior = counted  # type: ignore[method-assign]
        before = learner.last_refit
        wait_for("a refit", lambda: isinstance(learner.last_refit, report_process.Refitted) and
                 learner.last_refit is not before)  # fmt: skip
        refit = learner.last_refit
        assert isinstance(refit, report_process.Refitted)
        assert refit.pid != os.getpid()
        assert refit.nice == os.getpriority(os.PRIO_PROCESS, 0) + report_process.NICE
        time.sleep(0.5)  # a few more refits
        assert in_daemon == [], "no refit ran in the daemon once the child could"


def test_a_refit_queued_in_a_stopped_child_stays_the_childs(daemon, monkeypatch) -> None:
    """A refit the child has not done within its wait (queued behind reports, or a stopped child) is not started
    again, in the child or in the daemon: the learner counts it as done for this period, and the child does it."""
    reports, learner = daemon.reports, daemon.controller.learner
    in_daemon: list[float] = []
    monkeypatch.setattr(learner, "_refit_prior", lambda: in_daemon.append(time.monotonic()))
    monkeypatch.setattr(learner, "_last_prior_fit", 0.0)  # due
    submitted: list[object] = []
    submit = reports._submitted
    monkeypatch.setattr(reports, "_submitted", lambda *a: submitted.append(a[1]) or submit(*a))
    pid = reports._pool.submit(report_process._started).result(timeout=10)[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        learner.refit_prior(lambda samples: reports.refit_prior(samples, timeout_seconds=0.3))
        assert isinstance(learner.last_refit, report_process.Refitting)
        assert reports.refit_prior(100, timeout_seconds=0.3) == report_process.Refitting()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert in_daemon == [], "a refit late in the child ran in the daemon"
    assert submitted == [report_process._refit_prior], "a second refit was queued behind the first"
    wait_for("the child's refit", lambda: reports._refit is not None and reports._refit.done())
    assert isinstance(reports.refit_prior(100), report_process.Refitted)  # the next one: a new refit, answered
    assert submitted == [report_process._refit_prior] * 2


def test_a_child_stuck_on_a_refit_is_replaced(daemon, monkeypatch) -> None:
    """A refit waiting on a child that answers nothing for STUCK_SECONDS kills it, as a report would; the next call
    finds it broken and starts another."""
    monkeypatch.setattr(report_process, "STUCK_SECONDS", 0.5)
    reports = daemon.reports
    pid = reports._pool.submit(report_process._started).result(timeout=10)[0]
    restarts = reports.restarts
    os.kill(pid, signal.SIGSTOP)
    try:
        assert reports.refit_prior(100, timeout_seconds=0.3) == report_process.Refitting()  # quiet 0.3 s: waited on
        time.sleep(0.3)
        assert reports.refit_prior(100, timeout_seconds=0.3) == report_process.Refitting()  # quiet 0.9 s: killed
        wait_for("the stuck child gone", lambda: _gone(pid))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert reports.refit_prior(100, timeout_seconds=5) is None  # found broken: replaced
    wait_for("a new child", lambda: reports.ready and reports.restarts == restarts + 1)
    assert isinstance(reports.refit_prior(100, timeout_seconds=60), report_process.Refitted)
