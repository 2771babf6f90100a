"""The scheduler on its own (no HTTP, no process): the queue bound, cancellation, timeouts, draining, a decode
loop that fails, and a fault in one request's round that fails that request only. A tiny float64 Llama target (and,
where a test drafts with a model, a tiny draft)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from decoder.batch_engine import BatchEngine
from decoder.drafters import DraftModelDrafter, PromptLookupDrafter
from decoder.engine import DecodeSession
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from decoder.worker.scheduler import Job, JobOutcome, QueueFull, Scheduler, ShuttingDown, StepObservation
from specd_api.plan import Plan, runnable
from tests.conftest import tiny_lm


@pytest.fixture(scope="module")
def target(tokenizer):
    return tiny_lm("llama", tokenizer, seed=0)


class Recorder:
    """A job's callbacks, recorded; ``done`` is set by on_finish."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.started = False
        self.outcomes: list[JobOutcome] = []
        self.done = threading.Event()

    def job(self, target, max_new_tokens: int = 8, prompt: list[int] | None = None, timeout: float = 60.0) -> Job:
        self.job_ = Job(
            prompt_ids=prompt or [5, 6, 7, 8],
            params=SamplingParams(),
            rules=StopConditions(max_new_tokens, frozenset()),  # no EOS: every job runs to max_new_tokens
            plan=Plan("prompt_lookup", 2),
            timeout_seconds=timeout,
            on_tokens=self.tokens.extend,
            on_started=lambda seconds: setattr(self, "started", True),
            on_finish=self._finish,
        )
        return self.job_

    def _finish(self, outcome: JobOutcome) -> None:
        self.outcomes.append(outcome)
        self.done.set()

    def outcome(self, timeout: float = 30.0) -> JobOutcome:
        assert self.done.wait(timeout), "the job never finished"
        assert len(self.outcomes) == 1, "on_finish must run exactly once"
        return self.outcomes[0]


@pytest.fixture
def make(target) -> Iterator:
    """make(max_batch, max_queue) -> (scheduler, steps); stopped afterwards."""
    made: list[Scheduler] = []

    def make(max_batch: int, max_queue: int) -> tuple[Scheduler, list]:
        steps: list[StepObservation] = []
        engine = BatchEngine(target, max_batch=max_batch)
        scheduler = Scheduler(engine, max_queue, steps.append)
        made.append(scheduler)
        return scheduler, steps

    yield make
    for scheduler in made:
        scheduler.stop()


@pytest.mark.parametrize(
    ("max_batch", "max_queue", "accepted", "why"),
    [
        (1, 1, 2, "one takes the free slot, one waits"),
        (1, 0, 1, "one takes the free slot, none may wait"),
        (4, 0, 4, "free slots take four at once"),
        (2, 3, 5, "two slots and three waiting"),
    ],
)
def test_the_queue_bound_counts_only_requests_that_must_wait(make, target, max_batch, max_queue, accepted, why):
    scheduler, _ = make(max_batch, max_queue)  # not started: nothing leaves the queue
    for _ in range(accepted):
        scheduler.submit(Recorder().job(target))
    with pytest.raises(QueueFull):
        scheduler.submit(Recorder().job(target))
    assert scheduler.queue_depth == accepted, why


def test_jobs_run_to_their_end_and_report_each_step(make, target):
    scheduler, steps = make(max_batch=4, max_queue=4)
    recorders = [Recorder() for _ in range(3)]
    for n, recorder in zip((5, 9, 13), recorders, strict=True):
        scheduler.submit(recorder.job(target, max_new_tokens=n))
    scheduler.start()
    for n, recorder in zip((5, 9, 13), recorders, strict=True):
        outcome = recorder.outcome()
        assert outcome.status == "finished" and outcome.result is not None
        assert outcome.result.token_ids == recorder.tokens and len(recorder.tokens) == n
        assert recorder.started
        assert max(outcome.steps_in_batch) == 3, "the three were decoded together"
    assert max(s.batch_size for s in steps) == 3 and all(s.speculative for s in steps)
    assert scheduler.batch_size == scheduler.queue_depth == 0


def test_above_speculation_max_batch_steps_do_not_speculate(make, target):
    scheduler, steps = make(max_batch=4, max_queue=4)
    recorders = [Recorder(), Recorder()]
    for recorder in recorders:
        job = recorder.job(target, max_new_tokens=6)
        job.plan = runnable(job.plan, scheduler.engine.drafters, 1)  # as the worker queues it: its threshold 1
        scheduler.submit(job)
    scheduler.start()
    for recorder in recorders:
        assert recorder.outcome().status == "finished"
    assert {(s.batch_size, s.speculative) for s in steps} == {(2, False)}  # in lockstep, one token a step


@pytest.mark.parametrize(
    ("plan_threshold", "worker_threshold", "speculates", "why"),
    [(1, 8, False, "the plan's threshold under the worker's: the plan's applies as the batch grows to 2"),
     (2, 1, True, "the plan's threshold over the worker's: the plan's still applies (one threshold, the policy's)"),
     (None, 1, False, "a plan without one: the worker's own setting is the fallback")],
)  # fmt: skip
def test_the_plans_batch_threshold_applies_every_step(make, target, plan_threshold, worker_threshold, speculates, why):
    scheduler, steps = make(max_batch=4, max_queue=4)
    recorders = [Recorder(), Recorder()]
    for recorder in recorders:
        job = recorder.job(target, max_new_tokens=6)
        plan = Plan("prompt_lookup", 2, max_batch_size=plan_threshold)
        job.plan = runnable(plan, scheduler.engine.drafters, worker_threshold)  # as the worker queues it
        scheduler.submit(job)
    scheduler.start()
    outcomes = [recorder.outcome() for recorder in recorders]
    assert {(s.batch_size, s.speculative) for s in steps} == {(2, speculates)}, why
    rounds = [r for o in outcomes for r in o.result.stats.rounds]  # type: ignore[union-attr]
    assert any(r.k > 0 for r in rounds) is speculates, why


def slow_steps(scheduler: Scheduler, monkeypatch, seconds: float = 0.02) -> None:
    """Every step takes at least ``seconds``: a 400-token job then lasts over a second on any machine."""
    step = scheduler.engine.step

    def slow_step(sessions):
        time.sleep(seconds)
        return step(sessions)

    monkeypatch.setattr(scheduler.engine, "step", slow_step)


def test_a_cancelled_job_leaves_and_frees_its_slot(make, target, monkeypatch):
    scheduler, _ = make(max_batch=1, max_queue=2)
    slow_steps(scheduler, monkeypatch)
    running, waiting = Recorder(), Recorder()
    scheduler.submit(running.job(target, max_new_tokens=400))
    scheduler.submit(waiting.job(target, max_new_tokens=4))
    waiting.job_.cancel()  # cancelled while queued: never started
    scheduler.start()
    deadline = time.monotonic() + 10
    while not running.tokens and time.monotonic() < deadline:
        time.sleep(0.01)
    running.job_.cancel()  # cancelled while decoding
    assert running.outcome().status == "cancelled" and running.outcome().result is None
    assert waiting.outcome().status == "cancelled" and not waiting.started
    assert 0 < len(running.tokens) < 400
    after = Recorder()
    scheduler.submit(after.job(target, max_new_tokens=3))  # the slot is free again
    assert after.outcome().status == "finished"


def test_timeouts_in_the_queue_and_while_decoding(make, target, monkeypatch):
    scheduler, _ = make(max_batch=1, max_queue=2)
    slow_steps(scheduler, monkeypatch)
    running, waiting = Recorder(), Recorder()
    scheduler.submit(running.job(target, max_new_tokens=400, timeout=0.2))
    scheduler.submit(waiting.job(target, max_new_tokens=4, timeout=0.1))
    scheduler.start()
    assert running.outcome().status == "timeout" and "0.2 s" in str(running.outcome().error)
    assert waiting.outcome().status == "timeout" and "queued" in str(waiting.outcome().error)
    assert not waiting.started


def test_drain_finishes_admitted_jobs_and_refuses_new_ones(make, target):
    scheduler, _ = make(max_batch=1, max_queue=2)
    recorders = [Recorder(), Recorder()]
    for recorder in recorders:
        scheduler.submit(recorder.job(target, max_new_tokens=20))
    scheduler.start()
    assert scheduler.drain(timeout_seconds=30)
    assert [r.outcome().status for r in recorders] == ["finished", "finished"]
    with pytest.raises(ShuttingDown):
        scheduler.submit(Recorder().job(target))


def test_drain_waits_for_a_job_whose_prefill_is_running(make, target, monkeypatch):
    """A job taken from the queue is in neither the queue nor the batch while its prefill runs: a drain that looked
    only at those two returned early, and the worker's stop then cancelled the job ("the worker shut down")."""
    scheduler, _ = make(max_batch=1, max_queue=1)
    opening, release = threading.Event(), threading.Event()
    real_open = scheduler.engine.open

    def slow_open(*args, **kwargs):
        opening.set()
        release.wait(10)
        return real_open(*args, **kwargs)

    monkeypatch.setattr(scheduler.engine, "open", slow_open)
    recorder = Recorder()
    scheduler.submit(recorder.job(target, max_new_tokens=4))
    scheduler.start()
    assert opening.wait(10)
    drained: list[bool] = []
    drainer = threading.Thread(target=lambda: drained.append(scheduler.drain(timeout_seconds=30)))
    drainer.start()
    time.sleep(0.2)
    assert not drained, "the drain returned while a prefill was running"
    release.set()
    drainer.join(30)
    assert drained == [True] and recorder.outcome().status == "finished"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_failed_decode_loop_fails_its_jobs_refuses_new_ones_and_says_so(target, monkeypatch):
    """A fault outside every request's work (here: admitting) ends the loop: every job fails, new ones are refused,
    and ``on_failure`` is told (the worker process exits on it, to be restarted: tests/worker/test_faults.py)."""
    failures: list[BaseException] = []
    scheduler = Scheduler(BatchEngine(target, max_batch=2), 2, on_failure=failures.append)
    recorders = [Recorder(), Recorder()]
    for recorder in recorders:
        scheduler.submit(recorder.job(target, max_new_tokens=50))

    def broken_admit() -> None:
        raise RuntimeError("a bug in the scheduler")

    monkeypatch.setattr(scheduler, "_admit", broken_admit)
    try:
        scheduler.start()
        for recorder in recorders:
            outcome = recorder.outcome()
            assert outcome.status == "failed" and "a bug in the scheduler" in str(outcome.error)
        assert isinstance(scheduler.failure, RuntimeError) and failures == [scheduler.failure]
        with pytest.raises(ShuttingDown, match="decode loop failed"):  # nothing would decode it: refuse, not hang
            scheduler.submit(Recorder().job(target))
    finally:
        scheduler.stop()


# -- a fault in one request's round stays with that request (contract 10) ------------------------------------

POISON = [9, 9, 9, 9, 9, 9]  # the prompt whose round raises, a few rounds in
INNOCENT = [[5, 6, 7, 8, 10, 11], [12, 13, 14, 15, 16, 17]]


def _poisoned(context: torch.Tensor) -> bool:
    """The poisoned sequence, a few rounds in (``context``: its tokens, or those its draft model's cache holds)."""
    return context.shape[0] >= len(POISON) + 2 and context[:3].tolist() == POISON[:3]


FAULTS = {  # where the fault is injected: (class, method, the context that method sees)
    "accepting": (DecodeSession, "finish_round", lambda self, args: self.context),  # per sequence, after the pass
    "prompt lookup's draft": (PromptLookupDrafter, "propose", lambda self, args: args[0]),
    "the draft model's batched draft": (DraftModelDrafter, "pick", lambda self, args: self.cached_ids),
}


@pytest.fixture(scope="module")
def draft(tokenizer):
    return tiny_lm("llama", tokenizer, seed=1)


def run_jobs(target, draft, drafter: str, prompts: list[list[int]]) -> list[Recorder]:
    scheduler = Scheduler(BatchEngine(target, draft, max_batch=4), 4)
    recorders = [Recorder() for _ in prompts]
    for recorder, prompt in zip(recorders, prompts, strict=True):
        job = recorder.job(target, max_new_tokens=24, prompt=prompt)
        job.plan = Plan(drafter, 3)
        scheduler.submit(job)
    scheduler.start()
    try:
        for recorder in recorders:
            recorder.outcome()
        after = Recorder()  # the loop goes on
        scheduler.submit(after.job(target, max_new_tokens=4, prompt=INNOCENT[0]))
        assert after.outcome().status == "finished" and scheduler.failure is None
    finally:
        scheduler.stop()
    return recorders


@pytest.mark.parametrize(
    ("drafter", "where"),
    [
        ("prompt_lookup", "accepting"),
        ("prompt_lookup", "prompt lookup's draft"),
        ("draft", "accepting"),
        ("draft", "the draft model's batched draft"),
    ],
)
def test_a_round_that_raises_for_one_sequence_fails_that_request_only(target, draft, monkeypatch, where, drafter):
    """The poisoned request, batched between two others, fails (500, the error named); the others finish with the
    very tokens they decode without it (rewound and run alone after the failed batched round: nothing lost, nothing
    repeated), and the loop goes on: the exception must not kill the decode thread and make every later request a
    503."""
    cls, method, context_of = FAULTS[where]
    clean = [r.tokens for r in run_jobs(target, draft, drafter, INNOCENT)]
    original = getattr(cls, method)

    def faulty(self, *args, **kwargs):
        if _poisoned(context_of(self, args)):
            raise RuntimeError("a fault in one sequence")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, faulty)
    first, poisoned, second = run_jobs(target, draft, drafter, [INNOCENT[0], POISON, INNOCENT[1]])
    outcome = poisoned.outcome()
    assert outcome.status == "failed" and "a fault in one sequence" in str(outcome.error), outcome
    assert [first.outcome().status, second.outcome().status] == ["finished", "finished"]
    assert [first.tokens, second.tokens] == clean


def test_the_first_token_goes_out_at_the_prefill_before_any_round(make, target) -> None:
    # The prefill's own logits give the first token: the job hears it before the first round runs (a streaming
    # client sees it after the target's prefill, not after a drafter's prefill and a whole round).
    scheduler, _ = make(max_batch=2, max_queue=4)
    heard: list[tuple[list[int], int]] = []  # (tokens, the session's rounds when they were handed over)
    recorder = Recorder()
    job = recorder.job(target, max_new_tokens=6)

    def on_tokens(tokens: list[int]) -> None:
        assert job.session is not None
        heard.append((list(tokens), job.session.stats.num_rounds))
        recorder.tokens.extend(tokens)

    job.on_tokens = on_tokens
    scheduler.submit(job)
    scheduler.start()
    assert recorder.outcome().status == "finished"
    assert heard[0][1] == 0 and len(heard[0][0]) == 1, heard
    assert len(recorder.tokens) == 6


def test_a_one_token_job_finishes_at_its_prefill(make, target) -> None:
    scheduler, steps = make(max_batch=2, max_queue=4)
    recorder = Recorder()
    scheduler.submit(recorder.job(target, max_new_tokens=1))
    scheduler.start()
    outcome = recorder.outcome()
    assert outcome.status == "finished" and outcome.result is not None
    assert len(outcome.result.token_ids) == 1 and outcome.result.stats.num_rounds == 0
    assert steps == [], "no step ran for it"


def test_wait_idle_returns_once_no_sequence_decodes(make, target) -> None:
    scheduler, _ = make(max_batch=2, max_queue=4)
    assert scheduler.wait_idle(0.01), "nothing submitted: idle"
    recorder = Recorder()
    scheduler.submit(recorder.job(target, max_new_tokens=400))
    assert not scheduler.wait_idle(0.05), "a job waits in the queue: not idle"
    scheduler.start()
    assert not scheduler.wait_idle(0.05), "a job decodes: not idle"
    assert scheduler.wait_idle(60.0) and recorder.outcome().status == "finished"
    scheduler.stop()
    assert scheduler.wait_idle(0.01), "a stopped loop never holds its waiters"
