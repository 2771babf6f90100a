"""Where a prompt is tokenized (and a chat template rendered): off the event loop, in two lanes, each shared fairly
among client hosts, so that no client's large prompts hold up another client's request.

**Lanes.** A prompt of at most ``SMALL_PROMPT_CHARS`` characters goes to the small lane, a longer one to the large
lane; each lane is one thread. A small prompt never waits behind a large one: at most behind one small job per host
ahead of it (a 16 K-character prompt tokenizes in about 10 ms, CJK included).

**Fair per host.** Within a lane, jobs wait per client host, and the next job is the oldest of the waiting host
served least recently, so a host's job waits for the running job and at most one job of each other waiting host,
however many those hosts sent. A job whose request went away before its turn is dropped unrun.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Generic, TypeVar

SMALL_PROMPT_CHARS = 16_384  # at most this many characters: the small lane

T = TypeVar("T")


class FairLane(Generic[T]):
    """One job at a time on ``executor``; the next is the oldest job of the waiting host served least recently (a
    host that has not been served while it waits goes first). Event-loop only."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self.waiting: dict[str, deque[tuple[Callable[[], T], asyncio.Future[T]]]] = {}  # by arrival
        self.served: dict[str, int] = {}  # host -> the turn it last started a job in (hosts waiting or running)
        self.turns = itertools.count()
        self.busy = False

    async def run(self, host: str, work: Callable[[], T]) -> T:
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(host, deque()).append((work, future))
        self._next()
        return await future

    def _next(self) -> None:
        """Start the next job if the lane is free."""
        while not self.busy and self.waiting:
            host = min(self.waiting, key=lambda h: self.served.get(h, -1))
            jobs = self.waiting[host]
            work, future = jobs.popleft()
            if not jobs:
                del self.waiting[host]
            if future.done():  # the request went away while it waited
                if host not in self.waiting:
                    self.served.pop(host, None)
                continue
            self.busy = True
            self.served[host] = next(self.turns)
            running = asyncio.get_running_loop().run_in_executor(self.executor, work)
            running.add_done_callback(self._finisher(host, future))

    def _finisher(self, host: str, future: asyncio.Future[T]) -> Callable[[asyncio.Future[T]], None]:
        return lambda done: self._finished(host, done, future)

    def _finished(self, host: str, done: asyncio.Future[T], future: asyncio.Future[T]) -> None:
        self.busy = False
        if host not in self.waiting:
            del self.served[host]  # kept only for hosts waiting or running: bounded by the requests in flight
        if done.cancelled():
            future.cancel()
        elif not future.done():
            error = done.exception()
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(done.result())
        self._next()


class Tokenizing:
    """The worker's two lanes (``SMALL_PROMPT_CHARS``)."""

    def __init__(self) -> None:
        self.small: FairLane[list[int]] = FairLane(ThreadPoolExecutor(1, thread_name_prefix="specd-tokenize-small"))
        self.large: FairLane[list[int]] = FairLane(ThreadPoolExecutor(1, thread_name_prefix="specd-tokenize-large"))

    async def run(self, chars: int, host: str, work: Callable[[], list[int]]) -> list[int]:
        """``work`` (tokenizing a prompt of ``chars`` characters, sent by ``host``) in its lane."""
        lane = self.small if chars <= SMALL_PROMPT_CHARS else self.large
        return await lane.run(host, work)
