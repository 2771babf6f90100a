"""Each client host's share of the handler pool (serving/host_share.py): one host's flood of calls runs at
most ``max_calls_per_host`` of them at once, whatever its connections, its others waiting on the event loop, and
another host's call is let in at once. Decide takes no share: it runs on the event loop itself. The turns themselves
(order, cancellation) on an event loop; the daemon's over gRPC, with calls from two hosts of this machine (127.0.0.1
and ::1: the daemon listens on both). And each host's WatchDecisions streams (``max_watchers_per_host``): one host
cannot take every stream slot."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack

import grpc
import pytest

from controller.server import ControllerDaemon
from controller.serving.host_share import HostShares
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.daemons import ipv6_loopback, running_daemon

PER_HOST = 2
STREAMS_PER_HOST = 2
DRAFTER_SETS = 1  # the drafter sets kept at once, and those one host's streams may watch


# --- the turns ------------------------------------------------------------------------------------------------------


def test_a_host_runs_its_share_and_its_other_calls_follow_in_order() -> None:
    async def scenario() -> tuple[list[str], list[int]]:
        shares = HostShares(PER_HOST)
        order: list[str] = []
        running_seen: list[int] = []
        gates = {name: asyncio.Event() for name in "abcde"}

        async def call(name: str, host: str) -> None:
            async with shares.turn(host):
                order.append(name)
                running_seen.append(shares.running(host))
                await gates[name].wait()

        tasks = [asyncio.create_task(call(name, "10.0.0.1")) for name in "abcd"]
        await asyncio.sleep(0.01)
        assert order == ["a", "b"] and shares.waiting("10.0.0.1") == 2
        other = asyncio.create_task(call("e", "10.0.0.2"))  # another host: in at once
        await asyncio.sleep(0.01)
        assert order == ["a", "b", "e"]
        gates["b"].set()
        await asyncio.sleep(0.01)
        assert order == ["a", "b", "e", "c"]  # b's turn went to the first waiting
        for gate in gates.values():
            gate.set()
        await asyncio.gather(*tasks, other)
        assert shares.running("10.0.0.1") == shares.waiting("10.0.0.1") == 0
        assert shares._running == {} and shares._waiting == {}  # nothing kept for a host with no call
        return order, running_seen

    order, running_seen = asyncio.run(scenario())
    assert order == ["a", "b", "e", "c", "d"]
    assert max(running_seen) == PER_HOST


def test_a_call_cancelled_while_it_waits_leaves_and_a_turn_it_was_handed_passes_on() -> None:
    async def scenario() -> None:
        shares = HostShares(1)
        host = "10.0.0.1"
        first_gate = asyncio.Event()
        entered: list[str] = []

        async def call(name: str, gate: asyncio.Event | None = None) -> None:
            async with shares.turn(host):
                entered.append(name)
                if gate is not None:
                    await gate.wait()

        first = asyncio.create_task(call("first", first_gate))
        await asyncio.sleep(0.01)
        leaving = asyncio.create_task(call("leaving"))
        handed = asyncio.create_task(call("handed"))
        last = asyncio.create_task(call("last"))
        await asyncio.sleep(0.01)
        leaving.cancel()  # cancelled while it waits: out of the queue
        await asyncio.sleep(0.01)
        assert shares.waiting(host) == 2
        first_gate.set()  # its turn goes to "handed"...
        await asyncio.sleep(0)  # (first's exit runs, handing the turn over)
        handed.cancel()  # ... which is cancelled before it runs: the turn passes on to "last"
        done, _ = await asyncio.wait([first, last], timeout=5)
        assert last in done, "the turn handed to a cancelled call was lost: the host's next call never ran"
        assert leaving.cancelled() and handed.cancelled()
        assert entered == ["first", "last"]
        assert shares.running(host) == 0 and shares._running == {} and shares._waiting == {}

    asyncio.run(scenario())


def test_a_share_below_one_call_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one call"):
        HostShares(0)


# --- the daemon, over gRPC ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(embedded_redis_url, tmp_path_factory) -> Iterator[ControllerDaemon]:
    if not ipv6_loopback():
        pytest.skip("no IPv6 loopback on this machine: the test needs calls from two hosts (127.0.0.1 and ::1)")
    with running_daemon(
        embedded_redis_url, tmp_path_factory.mktemp("shares"), listen="localhost:0", max_workers=8,
        max_calls_per_host=PER_HOST, max_watchers_per_host=STREAMS_PER_HOST, max_drafter_sets=DRAFTER_SETS,
        max_drafter_sets_per_host=DRAFTER_SETS,
    ) as d:  # fmt: skip
        yield d


class Held:
    """The daemon's GetSegmentStats for segments named ``held-*`` wait for ``release`` (in the pool: Decide runs on
    the event loop, and holds no turn); ``inside`` counts them."""

    def __init__(self, daemon: ControllerDaemon, monkeypatch: pytest.MonkeyPatch) -> None:
        controller = daemon.controller
        assert controller is not None
        self.release = threading.Event()
        self.inside = 0
        self._lock = threading.Lock()
        view = controller.segment_view

        def held(segment, *features):
            if segment.startswith("held-"):
                with self._lock:
                    self.inside += 1
                self.release.wait(20)
            return view(segment, *features)

        monkeypatch.setattr(controller, "segment_view", held)

    def wait_inside(self, count: int) -> None:
        deadline = time.monotonic() + 10
        while self.inside < count:
            assert time.monotonic() < deadline, f"{self.inside} of {count} calls reached the handler"
            time.sleep(0.01)


def request(segment: str) -> pb.GetSegmentStatsRequest:
    return pb.GetSegmentStatsRequest(segment=segment)


def decide(segment: str) -> pb.DecideRequest:
    return pb.DecideRequest(segment=segment, batch_size=1, drafters=["draft"], max_new_tokens=64)


def channels(stack: ExitStack, address: str, count: int) -> list[pb_grpc.ControllerStub]:
    """``count`` stubs, each on a connection of its own."""
    stubs = []
    for i in range(count):
        own = [("grpc.use_local_subchannel_pool", 1), ("specd.test.connection", i)]
        channel = stack.enter_context(grpc.insecure_channel(address, options=own))
        stubs.append(pb_grpc.ControllerStub(channel))
    return stubs


def wait_for(what: str, ready) -> None:
    deadline = time.monotonic() + 10
    while not ready():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_one_hosts_flood_runs_its_share_and_another_host_is_served_meanwhile(daemon, monkeypatch) -> None:
    held = Held(daemon, monkeypatch)
    shares = daemon.shares
    registry = daemon.controller.learner.registry
    waited_before = registry.get_sample_value("specd_controller_calls_waited_for_host_turn_total") or 0.0
    with ExitStack() as stack:
        flood = [stub.GetSegmentStats.future(request("held-flood"), timeout=30)
                 for stub in channels(stack, f"[::1]:{daemon.port}", 5)]  # fmt: skip
        held.wait_inside(PER_HOST)
        wait_for("the flood's other calls to wait their turn", lambda: shares.waiting("::1") == 3)
        time.sleep(0.3)
        assert held.inside == PER_HOST  # 5 calls on 5 connections, 2 running: the rest hold no thread
        assert shares.running("::1") == PER_HOST
        waited = registry.get_sample_value("specd_controller_calls_waited_for_host_turn_total") - waited_before
        assert waited == 3, f"{waited} calls counted in /metrics as waiting their turn, 3 did"
        other = channels(stack, f"127.0.0.1:{daemon.port}", 1)[0]
        start = time.monotonic()
        other.GetSegmentStats(request("another-hosts-segment"), timeout=5)  # in at once, beside the flood
        assert time.monotonic() - start < 2.0
        flooding = channels(stack, f"[::1]:{daemon.port}", 1)[0]
        flooding.Decide(decide("held-decide"), timeout=5)  # Decide takes no turn: the flooding host's is answered
        held.release.set()
        for call in flood:
            call.result(timeout=20)  # every call of the flood answered in the end
        assert held.inside == 5
        wait_for("the turns to be given back", lambda: shares.running("::1") == 0 and shares.waiting("::1") == 0)


def test_a_call_that_gives_up_waiting_for_its_turn_leaves_no_trace(daemon, monkeypatch) -> None:
    held = Held(daemon, monkeypatch)
    shares = daemon.shares
    with ExitStack() as stack:
        stubs = channels(stack, f"[::1]:{daemon.port}", PER_HOST + 1)
        running = [stub.GetSegmentStats.future(request("held-running"), timeout=30) for stub in stubs[:PER_HOST]]
        held.wait_inside(PER_HOST)
        with pytest.raises(grpc.RpcError) as refused:
            stubs[-1].GetSegmentStats(request("held-late"), timeout=0.5)  # its deadline passes while it waits
        assert refused.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for("the late call to leave the queue", lambda: shares.waiting("::1") == 0)
        held.release.set()
        for call in running:
            call.result(timeout=20)
        wait_for("the turns to be given back", lambda: shares.running("::1") == 0)
        assert held.inside == PER_HOST  # the late call never ran


def test_one_host_holds_its_share_of_streams_and_another_host_still_opens_one(daemon, monkeypatch) -> None:
    watch = pb.WatchDecisionsRequest(worker_id="w", drafters=["draft"])
    handled: list[str] = []  # the hosts whose streams reached the handler (a pool thread)
    publisher_watch = daemon.publisher.watch

    def counted(*args, **kwargs):
        handled.append(kwargs["host"])
        return publisher_watch(*args, **kwargs)

    monkeypatch.setattr(daemon.publisher, "watch", counted)
    with ExitStack() as stack:
        flooding = channels(stack, f"[::1]:{daemon.port}", STREAMS_PER_HOST + 1)
        streams = [stub.WatchDecisions(watch, timeout=30) for stub in flooding[:STREAMS_PER_HOST]]
        for stream in streams:
            next(stream)  # open: its first message (every table)
        with pytest.raises(grpc.RpcError) as refused:
            next(flooding[-1].WatchDecisions(watch, timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_watchers_per_host" in refused.value.details() and "::1" in refused.value.details()
        # refused on the event loop, before a pool thread: a burst over the cap costs the handlers nothing
        assert handled == ["::1"] * STREAMS_PER_HOST
        other = channels(stack, f"127.0.0.1:{daemon.port}", 1)[0].WatchDecisions(watch, timeout=30)
        next(other)  # another host: its worker still gets a stream
        other.cancel()
        streams[0].cancel()  # a slot given back is the host's again
        wait_for("the cancelled stream's slot", lambda: daemon.publisher._per_host.get("::1", 0) < STREAMS_PER_HOST)
        again = flooding[-1].WatchDecisions(watch, timeout=30)
        next(again)
        for stream in (again, *streams[1:]):
            stream.cancel()
        wait_for("every stream to be counted off", lambda: daemon.publisher.watchers == 0)


def test_drafter_sets_are_capped_in_all_and_per_host_and_a_set_already_kept_is_always_watched(daemon) -> None:
    """Each drafter set watched is all the tables built and kept again: a host watches at most
    max_drafter_sets_per_host sets, the controller keeps at most max_drafter_sets, and a stream of a set already
    kept is never refused for its set. A set's place is given back with its last stream."""
    wait_for("no stream left by another test", lambda: daemon.publisher.watchers == 0)

    def watch(*drafters: str) -> pb.WatchDecisionsRequest:
        return pb.WatchDecisionsRequest(worker_id="w", drafters=list(drafters))

    with ExitStack() as stack:
        here = channels(stack, f"[::1]:{daemon.port}", 2)
        there = channels(stack, f"127.0.0.1:{daemon.port}", 2)
        kept = here[0].WatchDecisions(watch("draft"), timeout=30)
        next(kept)
        with pytest.raises(grpc.RpcError) as refused:
            next(here[1].WatchDecisions(watch("prompt_lookup"), timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_drafter_sets_per_host" in refused.value.details() and "::1" in refused.value.details()
        with pytest.raises(grpc.RpcError) as refused:
            next(there[0].WatchDecisions(watch("prompt_lookup", "draft"), timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "(max_drafter_sets)" in refused.value.details()
        same = there[0].WatchDecisions(watch("draft", "none"), timeout=30)  # the set kept: ["draft"]
        next(same)
        again = here[1].WatchDecisions(watch("draft"), timeout=30)  # a set the host watches already
        next(again)
        for stream in (kept, same, again):
            stream.cancel()
        wait_for("every stream to be counted off", lambda: daemon.publisher.watchers == 0)
        assert daemon.publisher._host_sets == {}, "a host's sets go with its last stream"
        other = there[1].WatchDecisions(watch("prompt_lookup"), timeout=30)  # the place given back
        next(other)
        other.cancel()
        wait_for("every stream to be counted off", lambda: daemon.publisher.watchers == 0)


def test_decide_is_served_on_the_event_loop_and_refuses_a_bad_request_from_there(daemon, monkeypatch) -> None:
    """Decide never hops to the pool (controller/server.py, ON_LOOP): it runs in the thread that read its request,
    and a request it refuses still ends with INVALID_ARGUMENT and its reason."""
    threads: list[str] = []
    real = daemon.controller.decide

    def recording(request):
        threads.append(threading.current_thread().name)
        return real(request)

    monkeypatch.setattr(daemon.controller, "decide", recording)
    with ExitStack() as stack:
        stub = channels(stack, f"127.0.0.1:{daemon.port}", 1)[0]
        assert stub.Decide(decide("on-the-loop"), timeout=5).segment == "on-the-loop"
        with pytest.raises(grpc.RpcError) as refused:
            stub.Decide(pb.DecideRequest(segment="bad segment!", batch_size=1), timeout=5)
    assert threads == ["specd-grpc-loop"]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "segment" in refused.value.details()


def test_one_host_holds_its_share_of_health_watch_streams_and_another_host_still_opens_one(daemon) -> None:
    """Health Watch needs no token: 10,000 streams from one client grew the controller by 200 MB, unbounded (issue
    22). One host opens MAX_HEALTH_STREAMS_PER_HOST, the next is refused with RESOURCE_EXHAUSTED naming the bound, a
    stream from the other host opens, and a stream the first host closes gives its place back."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from controller.serving.health_streams import MAX_HEALTH_STREAMS_PER_HOST, BoundedHealth

    request = health_pb2.HealthCheckRequest(service="")
    with ExitStack() as stack:
        channel = stack.enter_context(grpc.insecure_channel(f"[::1]:{daemon.port}"))
        streams = [health_pb2_grpc.HealthStub(channel).Watch(request, timeout=30)
                   for _ in range(MAX_HEALTH_STREAMS_PER_HOST)]  # fmt: skip
        assert all(next(s).status == health_pb2.HealthCheckResponse.SERVING for s in streams)
        with pytest.raises(grpc.RpcError) as refused:
            next(health_pb2_grpc.HealthStub(channel).Watch(request, timeout=10))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "MAX_HEALTH_STREAMS_PER_HOST" in refused.value.details() and "::1" in refused.value.details()
        other = stack.enter_context(grpc.insecure_channel(f"127.0.0.1:{daemon.port}"))
        another = health_pb2_grpc.HealthStub(other).Watch(request, timeout=30)
        assert next(another).status == health_pb2.HealthCheckResponse.SERVING
        assert health_pb2_grpc.HealthStub(channel).Check(request, timeout=10).status  # Check is not bounded
        streams[0].cancel()
        health = daemon._health
        assert isinstance(health, BoundedHealth)
        wait_for("the closed stream's place", lambda: health.open.of("::1") < MAX_HEALTH_STREAMS_PER_HOST)
        again = health_pb2_grpc.HealthStub(channel).Watch(request, timeout=30)
        assert next(again).status == health_pb2.HealthCheckResponse.SERVING
        for stream in (*streams[1:], another, again):
            stream.cancel()
    wait_for("every stream's place", lambda: daemon._health.open.total == 0)


def test_health_watch_streams_are_bounded_in_all() -> None:
    """The total bound, on the servicer itself: past max_streams a stream is refused, whichever host opens it."""
    from controller.serving.health_streams import BoundedHealth

    class Context:
        def __init__(self, host: str) -> None:
            self.host, self.written = host, 0

        def peer(self) -> str:
            return f"ipv4:{self.host}:1234"

        async def write(self, _: object) -> None:
            self.written += 1

        async def abort(self, code: grpc.StatusCode, details: str) -> None:
            raise grpc.RpcError(f"{code.name}: {details}")

    async def run() -> None:
        servicer = BoundedHealth(max_streams=3, per_host=2)
        from grpc_health.v1 import health_pb2

        request = health_pb2.HealthCheckRequest(service="")
        tasks = [asyncio.create_task(servicer.Watch(request, Context(f"10.0.0.{i}"))) for i in range(3)]
        await asyncio.sleep(0.01)
        assert servicer.open.total == 3
        with pytest.raises(grpc.RpcError, match="MAX_HEALTH_STREAMS\\)"):
            await servicer.Watch(request, Context("10.0.0.9"))
        tasks[0].cancel()
        await asyncio.gather(tasks[0], return_exceptions=True)
        assert servicer.open.total == 2 and "10.0.0.0" not in servicer.open.hosts()
        for task in tasks[1:]:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert servicer.open.total == 0 and servicer.open.hosts() == {}

    asyncio.run(run())
