"""The controller's gRPC server: grpc.aio on an event loop in a thread of its own, the handlers in a bounded pool.

Why asyncio: gRPC's synchronous server hands a call a pool thread as soon as its headers arrive, and the thread
then waits for the request message. Calls that send headers and never a message (refused ones too: a refusal waits
for the message as well) each hold one there, and about 270 of them take the whole pool: every Decide times out.
Here the event loop reads the headers, runs the interceptors and waits for the message; a handler gets a pool thread
only once its request is in, for as long as it computes. A call that never sends its message holds a coroutine and
an HTTP/2 stream (about 22 KiB), no thread: any number of them leave the pool to Decide.

The servicers stay synchronous (they do blocking Redis I/O and are thread-safe). A unary handler runs in the pool as
grpc.aio runs one (``migration_thread_pool``); a response stream (WatchDecisions) runs one message at a time in the
pool (``ThreadedStreams``), as grpc.aio's own bridge holds a thread for a stream's whole life and, once the client
has gone, never gives it back nor closes the generator. The rest of the daemon is threads: ``call`` runs a coroutine
on the loop (health updates) from any of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from concurrent import futures
from typing import Any, NoReturn, Protocol, TypeVar, runtime_checkable

import grpc

log = logging.getLogger("specd.controller.grpc")
T = TypeVar("T")
CALL_TIMEOUT_S = 10.0  # a coroutine handed to the loop (start, a health update) that takes longer is a bug
_END = object()


class ServerClosed(RuntimeError):
    """The server's loop has ended: a coroutine handed to it now would never run."""


class GrpcServer:
    """One grpc.aio server: ``start`` (the loop's thread, then the server), ``call``, ``stop`` (the drain), ``close``.
    Handlers run in ``pool`` (``threads`` threads at most)."""

    def __init__(
        self, threads: int, interceptors: Sequence[grpc.aio.ServerInterceptor], options: Sequence[tuple[str, Any]]
    ) -> None:
        self.pool = futures.ThreadPoolExecutor(threads, thread_name_prefix="specd-rpc")
        self._interceptors = [*interceptors, ThreadedStreams(self.pool)]
        self._options = list(options)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="specd-grpc-loop", daemon=True)
        self._server: grpc.aio.Server | None = None
        self._lock = threading.Lock()
        self._closed = False

    def start(
        self, listen: str, credentials: grpc.ServerCredentials | None, register: Callable[[grpc.aio.Server], None]
    ) -> int:
        """Start the loop, build the server on it, let ``register`` add the services, bind ``listen`` (TLS with
        ``credentials``) and serve. Returns the port; raises RuntimeError when the address cannot be bound."""
        self._thread.start()
        return self.call(self._start(listen, credentials, register))

    async def _start(
        self, listen: str, credentials: grpc.ServerCredentials | None, register: Callable[[grpc.aio.Server], None]
    ) -> int:
        server = grpc.aio.server(migration_thread_pool=self.pool, interceptors=self._interceptors,
                                 options=self._options)  # fmt: skip
        register(server)
        port = server.add_insecure_port(listen) if credentials is None else server.add_secure_port(listen, credentials)
        await server.start()
        self._server = server
        return int(port)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = CALL_TIMEOUT_S) -> T:
        """Run ``coroutine`` on the loop and wait for its result (from any thread but the loop's). Raises
        ServerClosed once ``close`` has begun, and CancelledError if the loop ended before the coroutine did."""
        with self._lock:
            if self._closed:
                coroutine.close()
                raise ServerClosed("the gRPC server is closed")
            future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        return future.result(timeout)

    def stop(self, grace: float) -> futures.Future[None]:
        """Refuse new calls; those in flight get ``grace`` seconds, then are cancelled. Done when no call is left;
        a second stop with a smaller grace cancels them sooner."""
        if self._server is None:
            done: futures.Future[None] = futures.Future()
            done.set_result(None)
            return done
        with self._lock:  # not yet closed: close() comes after stop()
            return asyncio.run_coroutine_threadsafe(self._server.stop(grace), self._loop)

    def close(self) -> None:
        """End the loop (after ``stop``); pool threads still in a handler end when it returns."""
        with self._lock:
            self._closed = True
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CALL_TIMEOUT_S)
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:  # what the stop left (calls cancelled at the end of the grace) ends here, not in a warning at exit
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()


class ThreadedStreams(grpc.aio.ServerInterceptor):
    """Serves a synchronous unary-stream handler (a generator: WatchDecisions) one message at a time in ``pool``.
    The controller has no synchronous client-streaming handler (reflection's is asynchronous)."""

    def __init__(self, pool: futures.Executor) -> None:
        self.pool = pool

        self._wrapped = PerMethod(self._wrap)

    async def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        return self._wrapped(details.method, await continuation(details))

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.unary_stream is None or is_async(handler.unary_stream):
            return handler
        return grpc.unary_stream_rpc_method_handler(
            stream_in_pool(handler.unary_stream, self.pool),
            request_deserializer=handler.request_deserializer,
            response_serializer=passing_bytes(handler.response_serializer),
        )


def passing_bytes(serializer: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """``serializer``, but a response that is bytes already goes as it is: a stream handler may send one message,
    serialized once, to many streams (a decision-table change to every WatchDecisions stream)."""
    if serializer is None:
        return None
    encode = serializer

    def serialize(response: Any) -> bytes:
        return response if type(response) is bytes else encode(response)

    return serialize


class PerMethod:
    """An interceptor's wrapping of a method's handler, built once per method rather than once per call: the
    service's handlers are one object per method, so the wrapped one can be kept and handed out again. Every call
    goes through every interceptor on the one event loop, so this is paid by every call, refused ones included (a
    burst of calls refused for their token is the loop's work and nothing else). ``wrap(handler, method)``
    returns the handler to serve; a ``None`` handler (no such method) passes through, and is never kept."""

    LIMIT = 256  # methods kept; the service has a handful, and a method name a client makes up finds no handler

    def __init__(self, wrap: Callable[[grpc.RpcMethodHandler, str], grpc.RpcMethodHandler]) -> None:
        self._wrap = wrap
        self._kept: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def __call__(self, method: str, handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
        if handler is None:
            return None
        kept = self._kept.get(method)
        if kept is not None and kept[0] is handler:
            return kept[1]
        wrapped = self._wrap(handler, method)
        if len(self._kept) < self.LIMIT:
            self._kept[method] = (handler, wrapped)
        return wrapped


def is_async(behavior: Callable[..., Any]) -> bool:
    """Does grpc.aio run ``behavior`` on the loop (a coroutine or async generator function)?"""
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


@runtime_checkable
class Beating(Protocol):
    """A stream's messages that also say when the stream owes its client a heartbeat (``table_publisher.Watch``):
    ``stream_in_pool`` sends ``beat()`` (unless None) whenever ``beat_in`` seconds pass while the next message waits."""

    def beat_in(self, now: float) -> float: ...

    def beat(self) -> Any | None: ...


def stream_in_pool(
    behavior: Callable[[Any, ThreadContext], Iterator[Any]], pool: futures.Executor
) -> Callable[[Any, grpc.aio.ServicerContext], AsyncIterator[Any]]:
    """``behavior`` as an async generator: each step (the call, then each ``next``) in ``pool``, no thread held
    between steps. However the call ends (the generator is done, the client cancelled, the server stopped), the
    context turns inactive, its callbacks run (they wake a step that waits for news) and the generator is closed
    once its step has returned: the thread is back in the pool, and the generator's ``finally`` has run."""

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        threaded = ThreadContext(context, asyncio.get_running_loop())
        step: futures.Future[Any] = pool.submit(behavior, request, threaded)
        responses: Iterator[Any] | None = None
        try:
            responses = iter(await asyncio.wrap_future(step))
            beating = responses if isinstance(responses, Beating) else None
            while True:
                step = pool.submit(next, responses, _END)
                pending = asyncio.wrap_future(step)
                while beating is not None:  # the heartbeats due while the step waits, from here: no thread woken
                    await asyncio.wait((pending,), timeout=beating.beat_in(time.monotonic()))  # (its sets unkept:
                    if pending.done():  # one would hold the done step, and its message, to the next wait's end)
                        break
                    beat = beating.beat()
                    if beat is not None:
                        yield beat
                response = await pending
                if response is _END:
                    return
                yield response
                # let go of it: the next message may be a long wait away (a stream's first, every table, 1.2 MiB at
                # 1,000 segments: 256 streams keeping theirs between changes would hold 1.1 GiB)
                del response, pending
        finally:
            threaded.end()
            if responses is not None:  # closed in the step's thread once it returns (at once if it is done)
                step.add_done_callback(_closer(responses))
            else:  # the call ended while the handler was still being called: close what it returns, once it does
                step.add_done_callback(_result_closer)

    return stream


def _result_closer(call: futures.Future[Any]) -> None:
    """Close the messages a handler returned after its call had ended (a ``WatchDecisions`` stream counts itself as a
    watcher from the call on: left open, it would hold a ``max_watchers`` slot for good)."""
    if not call.cancelled() and call.exception() is None:
        _closer(call.result())(call)


def _closer(responses: Iterator[Any]) -> Callable[[futures.Future[Any]], None]:
    def close(_: futures.Future[Any]) -> None:
        with contextlib.suppress(Exception):  # the call is over: nobody is left to tell
            getattr(responses, "close", lambda: None)()

    return close


class ThreadContext:
    """What a synchronous stream handler in the pool sees of its call: the part of ``grpc.ServicerContext`` the
    servicers use. ``is_active`` and ``add_callback`` are here because grpc.aio's own synchronous context has
    neither (a WatchDecisions stream asks ``is_active`` after each wait, and wakes on its callback)."""

    def __init__(self, context: grpc.aio.ServicerContext, loop: asyncio.AbstractEventLoop) -> None:
        self._context, self._loop = context, loop
        self._lock = threading.Lock()
        self._active = True
        self._callbacks: list[Callable[[], Any]] = []

    def invocation_metadata(self) -> Any:
        return self._context.invocation_metadata()

    def peer(self) -> str:
        return self._context.peer()

    def time_remaining(self) -> float | None:
        return self._context.time_remaining()

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        """The metadata sent with the call's status (set on the loop, before the status is sent)."""

        async def setting() -> None:
            self._context.set_trailing_metadata(tuple(metadata))

        asyncio.run_coroutine_threadsafe(setting(), self._loop).result()

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        """Send the status (on the loop) and raise, as grpc's abort does."""
        asyncio.run_coroutine_threadsafe(self._context.abort(code, details), self._loop).result()
        raise AssertionError("abort returned")  # it raises the call's AbortError

    def is_active(self) -> bool:
        with self._lock:
            return self._active

    def add_callback(self, callback: Callable[[], Any]) -> bool:
        """Call ``callback`` when the call ends; False (and never called) when it has ended already."""
        with self._lock:
            if self._active:
                self._callbacks.append(callback)
            return self._active

    def end(self) -> None:
        with self._lock:
            self._active, callbacks, self._callbacks = False, self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except Exception:  # one callback's failure must not skip the others
                log.exception("a callback at the end of a call failed")


class LoopAbort(Exception):
    """``LoopContext.abort``'s: the handler ended its call with ``code`` and ``details``."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code, self.details = code, details


class LoopContext(ThreadContext):
    """What a synchronous handler run on the loop itself sees of its call (``RequestWait``'s ``on_loop``): the loop
    cannot wait for itself, so ``abort`` raises LoopAbort, which the caller turns into the call's status."""

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise LoopAbort(code, details)


class InFlight(grpc.aio.ServerInterceptor):
    """Counts the unary handlers running, so that a shutdown can say how many its grace period cut short. A
    synchronous handler counts while it runs in the pool: a call the grace cancelled is counted until its handler
    returns, as it is still working."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0
        self._wrapped = PerMethod(self._wrap)

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        with self._lock:
            self._count += 1
        try:
            yield
        finally:
            with self._lock:
                self._count -= 1

    async def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        return self._wrapped(details.method, await continuation(details))

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if handler.unary_unary is None:
            return handler  # streams (health Watch, WatchDecisions, reflection): long-lived by design, not counted
        behavior = handler.unary_unary

        async def counted_on_loop(request: Any, context: Any) -> Any:
            with self.counting():
                return await behavior(request, context)

        def counted(request: Any, context: Any) -> Any:
            with self.counting():
                return behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(
            counted_on_loop if is_async(behavior) else counted,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
