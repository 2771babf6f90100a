"""The decode loop of the worker: one thread that owns the engine, admits queued requests between steps,
runs one batched round per step, and hands each request its tokens as they come.

Requests wait in a bounded queue (``submit`` refuses when it is full: the HTTP layer answers 429). Between
steps, waiting requests take free KV slots (prefill), and finished, cancelled or timed-out ones leave.
Each job's plan goes whole to the engine, which opens its sequence with a round policy built from it: every step,
each sequence drafts as its policy says at the step's batch size (its K ceiling, each round's K chosen by the plan's
rule, none at all above the plan's batch threshold: one target token per step).

A fault stays with its request (contract 10): a step that raises is retried sequence by sequence, and only a sequence
that fails on its own too is failed (500). Only a fault outside every request's work ends the loop: then every request
fails, /health says so, and ``on_failure`` is told (the worker process exits non-zero, for systemd to restart it).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from decoder.batch_engine import BatchEngine
from decoder.engine import DecodeSession, GenerationResult
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from decoder.worker.fault_injection import STALL_ROUND
from specd_api.plan import Plan

log = logging.getLogger("specd.worker")


class QueueFull(Exception):
    """The wait queue is at its bound; the caller should retry later."""


class ShuttingDown(Exception):
    """The worker is draining and takes no new requests."""


@dataclass(frozen=True)
class StepObservation:
    """What one step did, for metrics."""

    batch_size: int
    speculative: bool  # the batch rule let at least one sequence draft
    seconds: float


@dataclass(eq=False)
class Job:
    """One request on its way through the scheduler. Callbacks run on the scheduler thread: keep them short."""

    prompt_ids: list[int]
    params: SamplingParams
    rules: StopConditions
    plan: Plan  # what to run: its drafter, K ceiling, stop rule, per-round rule and batch threshold
    timeout_seconds: float
    on_tokens: Callable[[list[int]], None]  # every step's emitted tokens (maybe empty)
    on_started: Callable[[float], None]  # prefill done: its seconds
    on_finish: Callable[[JobOutcome], None]  # exactly once
    submitted_at: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    session: DecodeSession | None = None
    batch_sizes: list[int] = field(default_factory=list)  # the batch size at each step it took part in
    stall_seconds: float = 0.0  # fault injection: a stall inside its second round's timed pass (fault_injection.py)

    def cancel(self) -> None:
        """Stop at the next step boundary (a client went away). Safe from any thread."""
        self.cancelled = True


# How a job ended: "error" is the request's fault (e.g. a prompt over the context), "failed" the worker's.
JobStatus = Literal["finished", "cancelled", "timeout", "error", "failed"]


@dataclass(frozen=True)
class JobOutcome:
    status: JobStatus
    result: GenerationResult | None = None
    error: str | None = None
    steps_in_batch: tuple[int, ...] = ()  # the batch size at each step this request took part in


class Scheduler:
    """``engine`` is the engine, or a function that builds it: then it is built in the decode thread by ``start``.
    Building it there keeps every torch operation of the worker in one thread: PyTorch's OpenMP pool belongs to the
    thread that runs parallel work, and a second pool (left by loading the models in another thread) makes the
    decode thread's multi-token passes 20-40% slower on 2 cores (v(4) 1.7-1.8 instead of 1.2-1.4)."""

    def __init__(
        self,
        engine: BatchEngine | Callable[[], BatchEngine],
        max_queue: int,
        on_step: Callable[[StepObservation], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ) -> None:
        self._build = None if isinstance(engine, BatchEngine) else engine
        self._engine = engine if isinstance(engine, BatchEngine) else None
        self.max_queue = max_queue
        self.on_step = on_step or (lambda _: None)
        self.on_failure = on_failure or (lambda _: None)  # the decode loop died (called on its thread, once)
        self._queue: deque[Job] = deque()
        self._active: list[Job] = []
        lock = threading.RLock()
        self._wake = threading.Condition(lock)  # the decode loop waits for work on it
        self._accepting = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.failure: BaseException | None = None
        self._opening = 0  # jobs taken from the queue whose prefill is running (drain waits for them too)
        self._idle_now = threading.Condition(lock)  # notified when the loop runs out of work (wait_idle)

    @property
    def engine(self) -> BatchEngine:
        assert self._engine is not None, "the engine is built by start()"
        return self._engine

    # -- the HTTP side -------------------------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises QueueFull or ShuttingDown instead of waiting."""
        with self._wake:
            if self.failure is not None:
                raise ShuttingDown(f"the decode loop failed ({self.failure!r}); the worker needs a restart")
            if not self._accepting:
                raise ShuttingDown("the worker is shutting down")
            if len(self._queue) - self.engine.free_slots >= self.max_queue:  # beyond what free slots take now
                raise QueueFull(f"{len(self._queue)} requests are waiting")
            self._queue.append(job)
            self._wake.notify()

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def batch_size(self) -> int:
        return len(self._active)

    def load(self) -> int:
        """Sequences that will share the batch with one more request: active + waiting + it."""
        return len(self._active) + len(self._queue) + 1

    def wait_idle(self, timeout_seconds: float) -> bool:
        """Wait until no sequence is decoding, opening or waiting (or the decode loop has stopped), at most
        ``timeout_seconds``; True when idle. Background work (scoring, reports, the tables) waits here first: on two
        cores any thread that runs beside a decode takes a core from one of its threads, and a statically split
        pass then runs at that thread's pace (a busy Python thread beside a decode makes it 2.5x slower)."""
        with self._wake:
            return self._idle_now.wait_for(self._is_idle, timeout_seconds)

    def _is_idle(self) -> bool:  # under _wake
        return self._stopping or self.failure is not None or not (self._queue or self._active or self._opening)

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the decode thread; when the engine is still to be built, it is built there first, and ``start``
        returns once it is (re-raising what building it raised)."""
        assert self._thread is None, "start() twice"
        built = threading.Event()
        failed: list[BaseException] = []

        def run() -> None:
            if self._build is not None:
                try:
                    self._engine = self._build()
                except BaseException as e:
                    failed.append(e)
                    return
                finally:
                    built.set()
            self._run()

        self._thread = threading.Thread(target=run, name="specd-decode", daemon=True)
        self._thread.start()
        if self._build is not None:
            built.wait()
            if failed:
                self._thread.join()
                self._thread = None
                raise failed[0]

    def drain(self, timeout_seconds: float) -> bool:
        """Refuse new requests, let the admitted ones finish; True when all did within the timeout."""
        with self._wake:
            self._accepting = False
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self._idle():
                return True
            time.sleep(0.02)
        return self._idle()

    def _idle(self) -> bool:
        """Nothing queued, opening or decoding (a job being opened is in neither the queue nor the batch)."""
        with self._wake:
            return not self._queue and not self._active and self._opening == 0

    def stop(self) -> None:
        """Cancel whatever is left and end the thread."""
        with self._wake:
            self._accepting = False
            self._stopping = True
            self._wake.notify()
            self._idle_now.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # -- the decode thread ---------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    if self._stopping:
                        break
                    if not self._queue and not self._active:
                        self._idle_now.notify_all()
                        self._wake.wait(timeout=0.1)
                        continue
                self._admit()
                if self._active:
                    self._step()
        except BaseException as e:  # a bug in the engine: fail every request loudly, not silently hang
            with self._wake:
                self.failure = e  # and refuse new requests: nothing would decode them
                self._accepting = False
            for job in [*self._active, *self._queue]:
                self._finish(job, JobOutcome("failed", error=f"decode loop failed: {e!r}"))
            try:
                self.on_failure(e)
            except Exception as hook_error:
                log.error("the decode loop's failure hook failed: %r", hook_error)
            raise
        finally:
            for job in [*self._active, *self._queue]:
                self._finish(job, JobOutcome("cancelled", error="the worker shut down"))
            with self._wake:
                self._idle_now.notify_all()

    def _admit(self) -> None:
        while self.engine.free_slots:
            with self._wake:
                if not self._queue:
                    return
                job = self._queue.popleft()
                self._opening += 1
            try:
                self._open(job)
            finally:
                with self._wake:
                    self._opening -= 1

    def _open(self, job: Job) -> None:
        """Prefill one admitted job into the batch, or finish it (cancelled, timed out, refused by the engine)."""
        if job.cancelled:
            self._finish(job, JobOutcome("cancelled"))
            return
        if time.monotonic() - job.submitted_at > job.timeout_seconds:
            self._finish(job, JobOutcome("timeout", error=f"timed out after {job.timeout_seconds:g} s queued"))
            return
        started = time.perf_counter()
        try:
            job.session = self.engine.open(job.prompt_ids, job.params, job.rules, job.plan)
        except ValueError as e:  # a request the engine cannot run (e.g. a prompt longer than the context)
            self._finish(job, JobOutcome("error", error=str(e)))
            return
        except Exception as e:  # a bug met by this request's prefill: it fails, the loop goes on
            log.error("prefill failed, failing its request: %s", _one_line(e))
            self._finish(job, JobOutcome("failed", error=f"prefill failed: {e!r}"))
            return
        if job.stall_seconds > 0:
            self.engine.inject_stall(job.session, job.stall_seconds, STALL_ROUND)
        self._active.append(job)
        job.on_started(time.perf_counter() - started)
        try:  # the prefill's first token goes out now: it never waits for a round (nor its drafter)
            job.on_tokens(list(job.session.generated))
            if job.session.finish_reason is not None:  # EOS, a stop, or one token asked for
                self._finish(job, JobOutcome("finished", result=job.session.result()))
        except Exception as e:  # its result or callback raised: this request fails, the others go on
            log.error("a request failed after its prefill: %s", _one_line(e))
            self._finish(job, JobOutcome("failed", error=f"decoding failed: {e!r}"))

    def _step(self) -> None:
        batch = list(self._active)
        sessions: list[DecodeSession] = [job.session for job in batch]  # type: ignore[misc]
        speculative = any(s.policy.speculates_at(len(batch)) for s in sessions)
        started = time.perf_counter()
        emitted = self._round(sessions)
        self.on_step(StepObservation(len(batch), speculative, time.perf_counter() - started))
        now = time.monotonic()
        for job, tokens in zip(batch, emitted, strict=True):
            try:
                self._after_round(job, tokens, len(batch), now)
            except Exception as e:  # e.g. its result or callback raised: this request fails, the others go on
                log.error("a request failed after its round: %s", _one_line(e))
                self._finish(job, JobOutcome("failed", error=f"decoding failed: {e!r}"))

    def _round(self, sessions: list[DecodeSession]) -> list[list[int] | Exception]:
        """One round for every session: the tokens each emitted, or the error that failed it.

        When the batched round raises, the fault is found out: a session whose round was done keeps its tokens;
        each other one is rewound to its last whole round and run alone (a batch of one to its round policy), and
        fails only if it raises alone too."""
        before = [(len(s.generated), s.stats.num_rounds) for s in sessions]
        try:
            return list(self.engine.step(sessions))
        except Exception as e:
            if len(sessions) > 1:
                log.warning("a batched round of %d sequences failed (%s); running each alone", len(sessions),
                            _one_line(e))  # fmt: skip
            error: Exception = e
        emitted: list[list[int] | Exception] = []
        for s, (generated, rounds) in zip(sessions, before, strict=True):
            try:
                if s.stats.num_rounds == rounds:  # its round did not finish
                    if len(sessions) > 1:
                        s.rewind()
                        self.engine.step([s])
                    else:
                        raise error
                emitted.append(s.generated[generated:])
            except Exception as alone:
                log.error("a request failed in its round: %s", _one_line(alone))
                emitted.append(alone)
        return emitted

    def _after_round(self, job: Job, tokens: list[int] | Exception, batch_size: int, now: float) -> None:
        """Hand ``job`` its round's tokens, and finish it if it is done, cancelled, timed out or failed."""
        if isinstance(tokens, Exception):
            self._finish(job, JobOutcome("failed", error=f"decoding this request failed: {tokens!r}"))
            return
        job.batch_sizes.append(batch_size)
        job.on_tokens(tokens)
        session = job.session
        assert session is not None
        if session.finish_reason is not None:
            self._finish(job, JobOutcome("finished", result=session.result()))
        elif job.cancelled:
            self._finish(job, JobOutcome("cancelled"))
        elif now - job.submitted_at > job.timeout_seconds:
            self._finish(job, JobOutcome("timeout", error=f"timed out after {job.timeout_seconds:g} s"))

    def _finish(self, job: Job, outcome: JobOutcome) -> None:
        if job in self._active:
            self._active.remove(job)
        if job.session is not None:
            self.engine.close(job.session)
            job.session = None
        history = tuple(job.batch_sizes)
        with self._wake:
            if job in self._queue:
                self._queue.remove(job)
        try:
            job.on_finish(JobOutcome(outcome.status, outcome.result, outcome.error, history))
        except Exception as e:  # a callback's bug must not take the decode loop down
            print(f"specd worker: on_finish callback failed: {e!r}", flush=True)


def _one_line(e: BaseException) -> str:
    """``e`` and where it was raised, on one line: a request that fails again and again must not flood the log."""
    frames = traceback.extract_tb(e.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return f"{e!r}{where}"
