"""Reports validated and stored in a child process, so that their work never holds the daemon's interpreter; and the
prior's refits trained there, so that seconds of scikit-learn never compete with a decode at normal priority.

A report at the bounds (1,000 aggregates, 32,768 draft positions) takes about 75 ms of Python to validate and to
store (its Lua scripts' arguments built, its samples encoded). In the daemon that ran under the interpreter every
Decide needs: paced into 2 ms pieces, but each Decide still waited for the interpreter at every step, and one
client's reports at its budget tripled another client's Decide p99. Here the daemon hands the report's bytes as they
came (it parsed only their head: controller/serving/report_head.py) to one child process, at a lower scheduling priority
(``NICE``), which parses, validates and stores it in Redis with a store of its own (the same keys, scripts and client
settings: controller replicas already share one Redis), and answers what the daemon answers the worker. The daemon's
part is a pickle of the bytes and a wait holding no interpreter.

What stays in the daemon:

- the report budget and its hold (they run before any of this, on the event loop and in the handler);
- the journal: a report that comes while the journal holds a backlog (Redis was away) is the daemon's, in order
  behind it (``Learner.report``), and so is one the child could not store because Redis failed: the daemon tries it
  again and journals it;
- each segment's plain step time, which a report's realised speedups are read at (``Learner.step_seconds``): the
  daemon looks them up for the report's (segment, batch bucket) pairs, and the child reads those.

A report the child has not answered within ANSWER_SECONDS (queued behind other reports or a refit, or a Redis that
answers slowly) stays the child's: the daemon answers UNAVAILABLE, and the worker's retry of it (the same report id
from the same client host) waits on the same work, charged nothing more, so however long or many the reports, their
work is the child's. A child that has had work and answered nothing for STUCK_SECONDS (stopped, or wedged) is killed
and replaced.

The prior's refit (``refit_prior``: read the stored samples, fit, store the model, which the daemon's next refresh
loads) runs in the same child, between reports; one that waits behind them past its answer time stays the child's
too (``Refitting``), one at a time.

The child starts in the background when the daemon does (it imports the store and validation: about a second), and a
report that comes before it has answered, or while it is being replaced after it died, is the daemon's.
It is used only with the wall clock: a daemon on another clock (tests) keeps every report.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import redis
from google.protobuf.message import DecodeError

from controller.decision.prior import train_prior
from controller.serving.report_head import METHOD
from controller.serving.unparsable import undecodable
from controller.serving.validation import report as validated_report
from controller.storage.redis_conn import RedisTls, client_for
from controller.storage.store import StoreConfig, TelemetryStore
from specd_api.checks import MAX_BATCH_SIZE
from specd_api.modes import learning_segment
from specd_api.plan import batch_bucket
from specd_api.v1 import controller_pb2 as pb

log = logging.getLogger("specd.controller.reports")
NICE = 10  # the child's niceness over the daemon's: the OS gives the daemon's threads the cores first
PARENT_POLL_SECONDS = 1.0  # how soon a child whose daemon was killed exits
# A report at the bounds takes the child ~0.25 s; one not answered within this is answered UNAVAILABLE and stays the
# child's (one child stores the reports one at a time: a Redis that drops packets makes each wait its timeout)
ANSWER_SECONDS = 2.0
REFIT_SECONDS = 60.0  # a refit (scikit-learn's import and fit over the stored samples) takes seconds
MAX_HELD = 4096  # reports held for their retry, past which the answered ones are dropped (a retry then is a duplicate)
STUCK_SECONDS = REFIT_SECONDS + 30.0  # work outstanding and no answer for this long: the longest piece is a refit
FIRST_RETRY_SECONDS, MAX_RETRY_SECONDS = 1.0, 60.0  # a child that did not start is tried again, backing off
Steps = dict[tuple[str, int], float]  # (segment, batch bucket) -> a plain step's seconds there (0: not known)
Holder = tuple[str, str]  # (client host, report id): whose report, for the retry that waits on the same work


@dataclass(frozen=True)
class StoreSpec:
    """What the child builds its store from: the daemon's Redis address and client settings, and the store's."""

    url: str
    timeout_seconds: float
    tls: RedisTls | None
    store: StoreConfig


@dataclass(frozen=True)
class Stored:
    """The child stored the report (or found it stored before)."""

    report_id: str
    rounds: int
    duplicate: bool


@dataclass(frozen=True)
class Refitted:
    """The child refitted the prior (``stored``: a model was trained and stored; too little data trains none), in the
    process ``pid`` at niceness ``nice``."""

    stored: bool
    pid: int
    nice: int


@dataclass(frozen=True)
class Held:
    """The child holds the report (queued, or storing it) and has not answered within ANSWER_SECONDS: UNAVAILABLE,
    and the retry of ``report_id`` waits on the same work."""

    report_id: str


@dataclass(frozen=True)
class Refitting:
    """The child has a refit queued or running, not done within its wait: it stores the model when it is; no other
    refit is started meanwhile, here or in the daemon."""


@dataclass(frozen=True)
class Invalid:
    """The report breaks the wire contract: INVALID_ARGUMENT, with this reason."""

    reason: str


def report_steps(request: Any, step_seconds: Callable[[str, int], float]) -> Steps:
    """``step_seconds`` at each (learning segment, batch bucket) the report names (``request``: its ReportHead, or the
    ReportRoundsRequest); the aggregates are not validated yet, so a batch size out of range is left out
    (validation refuses the report)."""
    pairs = {
        (a.segment if a.start_up_timings else learning_segment(a.segment, a.temperature), a.batch_size)
        for a in request.aggregates
        if 1 <= a.batch_size <= MAX_BATCH_SIZE
    }
    steps: Steps = {}
    for segment, batch_size in pairs:
        key = (segment, batch_bucket(batch_size))
        if key not in steps:
            steps[key] = step_seconds(segment, batch_size)
    return steps


class ReportProcess:
    """The child process that validates and stores reports (see the module). ``ingest`` returns None whenever the
    daemon must do the report itself."""

    def __init__(self, spec: StoreSpec, nice: int = NICE) -> None:
        self.spec, self.nice = spec, nice
        self._lock = threading.RLock()  # a done callback may run at once, in the submitting thread
        self._pool: futures.ProcessPoolExecutor | None = None
        self._ready = False  # the current child has answered its first call
        self._closed = False
        self._retry_seconds = FIRST_RETRY_SECONDS / 2  # doubled before each wait for a child that did not start
        self._pid = 0  # the current child's, once it answered
        self._held: dict[Holder, futures.Future[Any]] = {}  # reports submitted and not yet answered to their caller
        self._outstanding = 0  # calls submitted to the current child and not done
        self._refit: futures.Future[Any] | None = None  # the last refit submitted to the current child
        self._quiet_since = 0.0  # monotonic: the child's last answer, or the submit that gave an idle child work
        self.restarts = 0

    def start(self) -> None:
        """Start the child (in the background: ``ingest`` returns None until it has answered)."""
        with self._lock:
            if self._closed:
                return
            context = multiprocessing.get_context("spawn")
            pool = futures.ProcessPoolExecutor(
                1, context, initializer=_start_child, initargs=(self.spec, self.nice, os.getpid())
            )
            self._pool, self._ready = pool, False
        try:
            pool.submit(_started).add_done_callback(lambda done: self._answered(pool, done))
        except RuntimeError:  # closed meanwhile
            pool.shutdown(wait=False, cancel_futures=True)

    def _answered(self, pool: futures.ProcessPoolExecutor, done: futures.Future[tuple[int, str]]) -> None:
        try:
            pid, not_niced = done.result()
        except Exception as e:  # it could not start (killed, a cluster's seed not answering): try again later
            with self._lock:
                if self._pool is not pool or self._closed:
                    return
                self._pool = None
                self._retry_seconds = min(2 * self._retry_seconds, MAX_RETRY_SECONDS)
                wait = self._retry_seconds
            log.warning("the report process did not start (%s): reports are validated and stored in the daemon; "
                        "trying again in %g s", e, wait)  # fmt: skip
            pool.shutdown(wait=False, cancel_futures=True)
            retry = threading.Timer(wait, self.start)
            retry.daemon = True
            retry.start()
            return
        with self._lock:
            self._retry_seconds = FIRST_RETRY_SECONDS / 2
            if self._pool is pool:
                self._ready, self._pid = True, pid
        if not_niced:
            log.warning("report process %d validates and stores reports, %s (allow setpriority)", pid, not_niced)
        else:
            log.info("report process %d validates and stores reports (nice +%d)", pid, self.nice)

    @property
    def ready(self) -> bool:
        return self._ready

    def ingest(self, data: bytes, steps: Steps, holder: Holder) -> Stored | Invalid | Held | None:
        """The child's answer to a report's bytes (``ReceivedReport.data``: the daemon never parses them whole), sent
        by ``holder`` (client host, report id). ``Held``: the child has it and has not answered within
        ANSWER_SECONDS; a later call for the same holder waits on the same work, not a second copy. None when the
        daemon must do the report itself: the child is not ready, it died (a new one is started), or Redis failed
        there (the daemon tries it again, then journals it)."""
        with self._lock:
            pool = self._pool if self._ready else None
            if pool is None:
                return None
            call = self._held.get(holder)
            if call is None:
                call = self._submitted(pool, _ingest, data, steps)
                if call is None:
                    return None
                if len(self._held) >= MAX_HELD:  # answers no retry came for
                    self._held = {h: c for h, c in self._held.items() if not c.done()}
                self._held[holder] = call
        try:
            outcome: Stored | Invalid | str = call.result(ANSWER_SECONDS)
        except TimeoutError:
            self._kill_if_stuck(pool)
            return Held(holder[1])
        except BrokenProcessPool:
            self._forget(holder, call)
            self._replace(pool)
            return None
        except (RuntimeError, futures.CancelledError):  # shut down meanwhile
            self._forget(holder, call)
            return None
        self._forget(holder, call)
        if isinstance(outcome, str):
            log.debug("the report process could not store a report (%s): the daemon does", outcome)
            return None
        return outcome

    def holds(self, holder: Holder) -> bool:
        """Whether the child has this (client host, report id)'s report, not yet answered to its caller."""
        with self._lock:
            return holder in self._held

    def refit_prior(self, samples_max: int, timeout_seconds: float = REFIT_SECONDS) -> Refitted | Refitting | None:
        """Refit the prior in the child (``Learner.refit_prior``'s work: the stored samples, at most ``samples_max``,
        trained and the model stored); ``Refitting`` when the child has one queued or running past
        ``timeout_seconds`` (behind reports); None when the daemon must do it: the child is not ready or died, or
        Redis failed there."""
        with self._lock:
            pool = self._pool if self._ready else None
            if pool is None:
                return None
            call = self._refit
            if call is None or call.done():
                call = self._submitted(pool, _refit_prior, samples_max)
                if call is None:
                    return None
                self._refit = call
        try:
            outcome: Refitted | str = call.result(timeout_seconds)
        except TimeoutError:
            self._kill_if_stuck(pool)
            return Refitting()
        except BrokenProcessPool:
            self._replace(pool)
            return None
        except (RuntimeError, futures.CancelledError):
            return None
        if isinstance(outcome, str):
            log.debug("the report process could not refit the prior (%s)", outcome)
            return None
        return outcome

    def _submitted(
        self, pool: futures.ProcessPoolExecutor, fn: Callable[..., Any], *args: Any
    ) -> futures.Future[Any] | None:
        """``fn(*args)`` in the child, counted outstanding until done (called under ``_lock``); None when the child
        died (it is replaced) or the pool was shut down meanwhile."""
        try:
            call = pool.submit(fn, *args)
        except BrokenProcessPool:
            self._replace(pool)
            return None
        except RuntimeError:
            return None
        if self._outstanding == 0:
            self._quiet_since = time.monotonic()
        self._outstanding += 1
        call.add_done_callback(lambda _: self._done(pool))
        return call

    def _done(self, pool: futures.ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is pool:
                self._outstanding -= 1
                self._quiet_since = time.monotonic()

    def _forget(self, holder: Holder, call: futures.Future[Any]) -> None:
        with self._lock:
            if self._held.get(holder) is call:
                del self._held[holder]

    def _kill_if_stuck(self, pool: futures.ProcessPoolExecutor) -> None:
        """Kill the child when it has had work and answered nothing for STUCK_SECONDS: its calls then fail as
        broken, and the next one replaces it."""
        with self._lock:
            if self._pool is not pool or not self._outstanding:
                return
            quiet = time.monotonic() - self._quiet_since
            if quiet < STUCK_SECONDS:
                return
            pid = self._pid
        log.warning("report process %d has answered nothing for %.0f s with work outstanding: killed and replaced",
                    pid, quiet)  # fmt: skip
        with contextlib.suppress(ProcessLookupError):  # it died meanwhile: the next call replaces it
            os.kill(pid, signal.SIGKILL)

    def _replace(self, broken: futures.ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is not broken or self._closed:
                return  # another call replaced it already
            self._pool, self._ready, self._held, self._outstanding, self._refit = None, False, {}, 0, None
            self.restarts += 1
        log.warning("the report process died; starting another (reports are the daemon's meanwhile)")
        broken.shutdown(wait=False, cancel_futures=True)
        self.start()

    def close(self) -> None:
        """Stop the child, once the report it may be storing is stored."""
        with self._lock:
            self._closed, pool, self._pool, self._ready = True, self._pool, None, False
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


# --- in the child ---------------------------------------------------------------------------------------------------

_store: TelemetryStore | None = None
_not_niced = ""  # why os.nice failed, if it did


def _start_child(spec: StoreSpec, nice: int, daemon: int) -> None:
    global _store, _not_niced
    threading.Thread(target=_exit_with, args=(daemon,), name="report-process-parent", daemon=True).start()
    _not_niced = lower_priority(nice)
    _store = TelemetryStore(client_for(spec.url, spec.timeout_seconds, spec.tls), spec.store, time.time)


def lower_priority(nice: int) -> str:
    """Lower this process's priority by ``nice``; "" when done, else why not (a seccomp filter without
    setpriority: the process runs on at its priority)."""
    try:
        os.nice(nice)
    except OSError as e:
        return f"not niced: {e}"
    return ""


def _exit_with(parent: int) -> None:
    """End the child once the daemon is gone (killed: nothing else would, outside systemd's control group), or at
    once if it went before the child had started."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_SECONDS)
    os._exit(0)


def _started() -> tuple[int, str]:
    """The child's pid, and why it is not niced ("" when it is)."""
    return os.getpid(), _not_niced


def _ingest(data: bytes, steps: Steps) -> Stored | Invalid | str:
    """Parse, validate and store one report; a string says why Redis did not take it."""
    assert _store is not None, "the child's initializer builds the store"
    try:
        report_id, aggregates = validated_report(pb.ReportRoundsRequest.FromString(data))
    except DecodeError as e:  # its head parsed in the daemon, the rest does not
        return Invalid(undecodable(METHOD, e))
    except ValueError as e:
        return Invalid(str(e))

    def step_seconds(segment: str, batch_size: int) -> float:
        return steps.get((segment, batch_bucket(batch_size)), 0.0)

    try:
        result = _store.ingest(report_id, aggregates, step_seconds)
    except redis.RedisError as e:
        return f"{type(e).__name__}: {e}"
    return Stored(report_id, result.rounds, result.duplicate)


def _refit_prior(samples_max: int) -> Refitted | str:
    """Train the prior from the stored samples and store it; a string says why Redis did not answer."""
    assert _store is not None, "the child's initializer builds the store"
    try:
        model = train_prior(_store.read_samples(samples_max))
        if model is not None:
            _store.save_prior(model.to_json())
    except redis.RedisError as e:
        return f"{type(e).__name__}: {e}"
    return Refitted(model is not None, os.getpid(), os.getpriority(os.PRIO_PROCESS, 0))
