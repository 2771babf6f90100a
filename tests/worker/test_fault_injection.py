"""Fault injection (decoder/worker/fault_injection.py): a stall the worker puts into its own work lands inside the
timed target pass of the chosen request's second round, so the round record, the request's decode seconds and the
telemetry all carry it. Which requests stall is a seeded draw."""

from __future__ import annotations

import random
import threading

import pytest
from pydantic import ValidationError

from decoder.batch_engine import BatchEngine
from decoder.request_stop import StopConditions
from decoder.sampling import SamplingParams
from decoder.worker.config import FaultInjection, WorkerConfig
from decoder.worker.fault_injection import STALL_ROUND, StallPicker
from decoder.worker.scheduler import Job, JobOutcome, Scheduler
from specd_api.plan import Plan
from tests.conftest import tiny_lm
from tests.worker.conftest import done_info, in_process, service_config

STALL = 0.3  # seconds: far above a tiny model's round (about a millisecond), far under the tests' patience


@pytest.fixture(scope="module")
def target(tokenizer):
    return tiny_lm("llama", tokenizer, seed=0)


def run_job(scheduler: Scheduler, stall_seconds: float, plan: Plan) -> JobOutcome:
    done: list[JobOutcome] = []
    finished = threading.Event()
    job = Job(prompt_ids=[5, 6, 7, 8, 5, 6, 7], params=SamplingParams(), rules=StopConditions(8, frozenset()),
              plan=plan, timeout_seconds=60, on_tokens=lambda _: None, on_started=lambda _: None,
              on_finish=lambda o: (done.append(o), finished.set()), stall_seconds=stall_seconds)  # fmt: skip
    scheduler.submit(job)
    assert finished.wait(30), "the job never finished"
    return done[0]


@pytest.mark.parametrize("plan", [Plan("none", 0), Plan("prompt_lookup", 3)], ids=["none", "prompt_lookup"])
def test_the_stall_lands_inside_the_timed_pass_of_the_second_round_once(target, plan):
    scheduler = Scheduler(BatchEngine(target, max_batch=2), max_queue=4)
    scheduler.start()
    try:
        stalled = run_job(scheduler, STALL, plan)
        plain = run_job(scheduler, 0.0, plan)
    finally:
        scheduler.stop()
    assert stalled.result is not None and plain.result is not None
    rounds = stalled.result.stats.rounds
    assert len(rounds) > STALL_ROUND + 1
    slow = [i for i, r in enumerate(rounds) if r.verify_seconds >= STALL]
    assert slow == [STALL_ROUND], [r.verify_seconds for r in rounds]  # that round, once, in its verify time
    assert all(r.draft_seconds < STALL for r in rounds)
    assert stalled.result.stats.decode_seconds >= STALL
    assert plain.result.stats.decode_seconds < STALL  # the next request is not stalled
    assert stalled.result.token_ids == plain.result.token_ids  # a stall changes timings, never tokens


def test_the_picker_stalls_a_seeded_share_of_requests():
    def draws(share: float, seed: int, n: int = 2000) -> list[float]:
        picker = StallPicker(FaultInjection(stall_share=share, stall_ms=250, seed=seed))
        return [picker.draw() for _ in range(n)]

    assert set(draws(0.0, 1)) == {0.0}
    assert set(draws(1.0, 1)) == {0.25}
    some = draws(0.2, 7)
    assert some == draws(0.2, 7) and some != draws(0.2, 8)  # seeded: the same requests again, others for another
    assert set(some) == {0.0, 0.25} and 0.17 < some.count(0.25) / len(some) < 0.23
    expected = random.Random(7)
    assert [s > 0 for s in some[:50]] == [expected.random() < 0.2 for _ in range(50)]  # in submission order
    assert not StallPicker(FaultInjection()).active  # the default is off
    assert not StallPicker(FaultInjection(stall_share=0.5, stall_ms=0)).active


BAD_SETTINGS = [{"stall_share": 1.5}, {"stall_share": -0.1}, {"stall_ms": -1.0}, {"stall_share": float("nan")},
                {"stall_ms": 1e9}, {"stall_rate": 0.1}]  # fmt: skip


@pytest.mark.parametrize("settings", BAD_SETTINGS)
def test_bad_fault_injection_settings_are_refused(settings):
    with pytest.raises(ValidationError):
        WorkerConfig(fault_injection=settings)


def test_a_worker_set_to_stall_every_request_reports_the_stall_in_its_decode_seconds(tiny_pair):
    config = service_config(
        tiny_pair, warm_up=False, controller={"address": None},
        fault_injection={"stall_share": 1.0, "stall_ms": STALL * 1000, "seed": 0},
    )  # fmt: skip
    with in_process(config) as service:
        info = done_info(service, "stall", max_new_tokens=6)
    assert info["num_rounds"] > STALL_ROUND + 1
    assert info["decode_seconds"] >= STALL  # what the response, and the telemetry, report
