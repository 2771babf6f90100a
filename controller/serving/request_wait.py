"""A call's request message has ``REQUEST_WAIT_SECONDS`` to arrive, and at most ``MAX_WAITING_CALLS`` calls wait for
theirs at once.

grpc.aio waits for a call's request message on the event loop, holding no thread, but with no deadline: a call that
sends its headers and never its message (a valid token, or no token configured) holds its coroutine and its HTTP/2
stream, about 22 KiB, until its client goes away, and nothing but the number of connections bounds how many do.
``RequestWait`` serves each method that takes one request (unary and response-streaming: Decide, ReportRounds,
WatchDecisions, health Check and Watch) as a request-streaming one, which carries the same frames on the wire (every
gRPC call is an HTTP/2 stream; only the server's way of reading it changes), so that its own coroutine reads the
request, under a deadline:

- a call whose request (its message, then the end of its request stream) is not in within ``wait_seconds`` ends with
  DEADLINE_EXCEEDED, naming the bound, and its memory is freed;
- with ``max_waiting`` calls already waiting, or ``max_waiting_per_host`` of its client host's, a new one is not
  counted and waits ``OVER_CAP_WAIT_SECONDS`` (0.1 s)
  at most: a real client's request is in by then and is served (so a flood of waiting calls cannot refuse Decide),
  a silent call is refused with RESOURCE_EXHAUSTED. Memory is bounded by the cap, plus the calls that arrive in
  0.1 s, whatever the number of connections;
- a call that ends its request stream with no message, or sends a second one, is refused with INVALID_ARGUMENT (a
  unary method takes exactly one message), not with the INTERNAL or UNKNOWN a server error would be;
- a method's gate (``gates``: WatchDecisions' stream caps) is asked once the request is in, and a call it refuses
  ends with RESOURCE_EXHAUSTED there, on the loop: a burst of streams over their caps, each refused from a pool
  thread and back, would stall another host's Decide. The handler checks the limit again, and decides.

Then the method runs as grpc.aio would run it: a synchronous handler in the pool (one hop to a thread, as ever;
``InFlight`` counts it there) once its client host has a turn (``host_share``: a host's flood waits on the loop,
holding no thread), a coroutine or an async generator (health, WatchDecisions as ``ThreadedStreams``
serves it) on the loop. The interceptor goes after the token check (a refused call never reaches it, and costs no
more for it) and before every interceptor that wraps a unary handler (they see the handler they know).

The counter of waiting calls is only touched by coroutines on the server's one event loop: no lock.
``SPECD_REQUEST_WAIT_SECONDS``, ``SPECD_MAX_WAITING_CALLS`` and ``SPECD_MAX_WAITING_CALLS_PER_HOST`` in the
environment change the bounds (read once, at start-up; the tests use short ones).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import os
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from concurrent import futures
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from controller.serving.auth import RefusalLog
from controller.serving.grpc_server import LoopAbort, LoopContext, PerMethod, ThreadContext, is_async
from controller.serving.host_share import HostShares
from controller.serving.report_budget import MAX_HOLD_SECONDS, peer_host
from specd_api.host_counts import HostCounts

# A client sends its request with its headers: on a loopback or a LAN it is in within a millisecond, and the largest
# one the port accepts (MAX_REPORT_BYTES, 1 MiB) crosses a 1 Mbit/s link in 8 s. 10 s keeps every real caller and
# bounds what a stuck or hostile one holds to 10 s.
REQUEST_WAIT_SECONDS = 10.0
# About 22 KiB each: 1,000 waiting calls hold about 22 MiB. Real calls wait a millisecond, so even 100,000 calls a
# second keep about 100 of them waiting at once; past 1,000 the waiting ones are a flood, not traffic.
MAX_WAITING_CALLS = 1000
# One client host's share of them: a host past it waits like a call past the cap, so one host's flood of waiting calls
# (health checks need no token) leaves the other hosts' calls their full wait (a report crossing a slow link can take
# most of a second, and the 0.1 s of a call past the cap would refuse it).
MAX_WAITING_CALLS_PER_HOST = 250
# Past the cap a new call is not refused before it reads: whether its request is already in (a real client sends it
# with the headers) shows only once a read returns, and refusing it unread would let a flood of waiting calls refuse
# every Decide. It gets this long instead (well past a Decide's own deadline of a few ms), then RESOURCE_EXHAUSTED.
OVER_CAP_WAIT_SECONDS = 0.1
NO_MESSAGE = "the call ended its request stream without a message: this method takes one"
SECOND_MESSAGE = "a second request message came: this method takes one"
WAIT_ENV, MAX_WAITING_ENV = "SPECD_REQUEST_WAIT_SECONDS", "SPECD_MAX_WAITING_CALLS"
PER_HOST_ENV = "SPECD_MAX_WAITING_CALLS_PER_HOST"
Hold = Callable[[str], float]  # a client host -> seconds to hold its call before reading the request
Gate = Callable[[str], str | None]  # a client host -> why its call is refused now (RESOURCE_EXHAUSTED), or None


@dataclass(frozen=True)
class WaitLimits:
    wait_seconds: float = REQUEST_WAIT_SECONDS  # for the request message and the end of the request stream
    max_waiting: int = MAX_WAITING_CALLS  # calls waiting for their request at once, every method together
    max_waiting_per_host: int = MAX_WAITING_CALLS_PER_HOST  # ... of them from one client host

    def __post_init__(self) -> None:
        if not (math.isfinite(self.wait_seconds) and self.wait_seconds > 0):
            raise ValueError(f"{WAIT_ENV} must be a positive number of seconds, not {self.wait_seconds!r}")
        if self.max_waiting < 1:
            raise ValueError(f"{MAX_WAITING_ENV} must be at least 1, not {self.max_waiting!r}")
        if self.max_waiting_per_host < 1:
            raise ValueError(f"{PER_HOST_ENV} must be at least 1, not {self.max_waiting_per_host!r}")

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> WaitLimits:
        """The defaults, or what ``SPECD_REQUEST_WAIT_SECONDS`` and ``SPECD_MAX_WAITING_CALLS`` say. Raises
        ValueError for a value that is not a number, or out of range."""
        env = os.environ if environ is None else environ
        try:
            wait = float(env.get(WAIT_ENV) or REQUEST_WAIT_SECONDS)
        except ValueError:
            raise ValueError(f"{WAIT_ENV} must be a number of seconds, not {env[WAIT_ENV]!r}") from None
        counts = {}
        for name, default in ((MAX_WAITING_ENV, MAX_WAITING_CALLS), (PER_HOST_ENV, MAX_WAITING_CALLS_PER_HOST)):
            try:
                counts[name] = int(env.get(name) or default)
            except ValueError:
                raise ValueError(f"{name} must be a whole number, not {env[name]!r}") from None
        return cls(wait, counts[MAX_WAITING_ENV], counts[PER_HOST_ENV])


class RequestWait(grpc.aio.ServerInterceptor):
    """Reads the request of every method that takes one, within ``limits`` (see the module). ``serve_in`` names the
    pool synchronous handlers run in (the server's, built with it) before the server starts."""

    def __init__(
        self, limits: WaitLimits, refusals: RefusalLog | None = None, holds: Mapping[str, Hold] | None = None,
        shares: HostShares | None = None, gates: Mapping[str, Gate] | None = None, on_loop: Collection[str] = (),
    ) -> None:  # fmt: skip
        self.limits = limits
        self.shares = shares or HostShares()  # a synchronous handler's turn in the pool, per client host
        self.refusals = refusals or RefusalLog()
        self.holds = dict(holds or {})  # method -> how long to hold a peer's call before reading its request
        self.gates = dict(gates or {})  # method -> a limit checked on the loop once the request is in (the module)
        self.on_loop = frozenset(on_loop)  # methods whose synchronous handlers run on the loop (the module)
        self.waiting = HostCounts()  # calls waiting for their request now, by client host; only the loop's
        # coroutines touch it
        self._pool: futures.Executor | None = None
        self._wrapped = PerMethod(self._wrap)

    def serve_in(self, pool: futures.Executor) -> None:
        self._pool = pool

    async def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        return self._wrapped(details.method, await continuation(details))

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.request_streaming:
            return handler  # the method reads its requests itself (reflection)
        if handler.unary_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if is_async(handler.unary_stream):  # a synchronous one would hold a thread for its stream: none is served
            return grpc.stream_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    def _unary(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        if is_async(behavior):

            async def unary_on_loop(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                return await behavior(await self._request(context, method), context)

            return unary_on_loop
        if method in self.on_loop:

            async def unary_here(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                request = await self._request(context, method)
                here = LoopContext(context, asyncio.get_running_loop())
                try:
                    return behavior(request, here)
                except LoopAbort as aborted:
                    await context.abort(aborted.code, aborted.details)
                    raise AssertionError("abort returned") from None
                finally:
                    here.end()

            return unary_here
        pool = self._pool
        assert pool is not None, "RequestWait.serve_in(pool) comes before the server starts"

        async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            request = await self._request(context, method)
            loop = asyncio.get_running_loop()
            async with self.shares.turn(peer_host(context.peer())):  # the host's turn: its flood waits here
                threaded = ThreadContext(context, loop)
                try:  # what grpc.aio does for a synchronous unary handler: one hop to the pool, then its callbacks
                    return await loop.run_in_executor(pool, behavior, request, threaded)
                finally:
                    threaded.end()

        return unary

    def _stream(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(behavior):  # it writes its responses itself (health Watch)

            async def writing(requests: Any, context: grpc.aio.ServicerContext) -> None:
                await behavior(await self._request(context, method), context)

            return writing

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            request = await self._request(context, method)
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

        return stream

    async def _request(self, context: grpc.aio.ServicerContext, method: str) -> Any:
        """The call's one request message, once its request stream has ended; the call is ended instead (an
        AbortError raised) when its request is late (RESOURCE_EXHAUSTED past the cap, else DEADLINE_EXCEEDED), or
        when there is not exactly one message."""
        limits = self.limits
        host = peer_host(context.peer())
        waiting = self.waiting
        counted = waiting.total < limits.max_waiting and waiting.of(host) < limits.max_waiting_per_host
        if counted:
            waiting.add(host)
        hold = self.holds.get(method)
        try:
            async with asyncio.timeout(limits.wait_seconds if counted else OVER_CAP_WAIT_SECONDS):
                if hold is not None and (seconds := hold(host)) > 0:
                    await asyncio.sleep(min(seconds, MAX_HOLD_SECONDS))  # on the loop: no thread, nothing read
                request = await context.read()  # one deadline for both reads, and no task of its own
                extra = grpc.aio.EOF if request is grpc.aio.EOF else await context.read()
        except TimeoutError:
            if counted:
                late = f"the request did not arrive within {limits.wait_seconds:g} s (REQUEST_WAIT_SECONDS)"
                await self._refuse(context, method, grpc.StatusCode.DEADLINE_EXCEEDED, late)
            busy = (f"{limits.max_waiting} calls, or {limits.max_waiting_per_host} of this host's, are waiting for "
                    "their request (MAX_WAITING_CALLS, MAX_WAITING_CALLS_PER_HOST): send yours with it")  # fmt: skip
            await self._refuse(context, method, grpc.StatusCode.RESOURCE_EXHAUSTED, busy)
        finally:
            if counted:
                waiting.remove(host)
        if request is grpc.aio.EOF:
            await self._refuse(context, method, grpc.StatusCode.INVALID_ARGUMENT, NO_MESSAGE)
        if extra is not grpc.aio.EOF:
            await self._refuse(context, method, grpc.StatusCode.INVALID_ARGUMENT, SECOND_MESSAGE)
        gate = self.gates.get(method)
        if gate is not None and (refused := gate(host)) is not None:
            await self._refuse(context, method, grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        return request

    async def _refuse(
        self, context: grpc.aio.ServicerContext, method: str, code: grpc.StatusCode, why: str
    ) -> NoReturn:
        """Ends the call with ``code`` (grpc.aio's abort raises its AbortError, which ends the handler too)."""
        self.refusals.note(method, context.peer(), code, why)
        await context.abort(code, f"{method}: {why}")
        raise AssertionError("abort returned")
