"""Contract 2 with real processes: the worker never fails a request because of the controller.

The controller is SIGKILLed in the middle of concurrent load. Every request still completes; decisions made
while it is gone are fallbacks (the segment's last decision, or the local default), they take about the
deadline or less, and the worker counts them. The controller is then restarted on the same port with the same
state_dir: the restart stops the embedded Redis the killed one left behind, decisions come from the controller
again, and the reports the worker buffered during the outage arrive (the controller's counts equal the worker's
once more).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from controller.storage.redis_conn import PID_FILE, _running
from tests.e2e.conftest import Stack
from tests.e2e.traffic import Metrics, Reply, complete, in_threads, mixed_workload, wait_for_reports, wait_until
from workloads import Prompt

DEADLINE_MS = 5.0
MAX_TOKENS = 16
OUTAGE_TOKENS = 2
THREADS = 3


def histogram_delta(before: Metrics, after: Metrics, name: str) -> list[tuple[float, float]]:
    old = dict(before.histogram(name))
    return [(bound, count - old.get(bound, 0.0)) for bound, count in after.histogram(name)]


def quantile(buckets: list[tuple[float, float]], q: float) -> tuple[float, float]:
    """(estimate, bucket upper bound) of quantile ``q`` of cumulative buckets, interpolated within the bucket
    as Prometheus' histogram_quantile does."""
    total = buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= q * total:
            if bound == float("inf"):
                return lower, bound
            return lower + (bound - lower) * (q * total - below) / max(count - below, 1e-12), bound
        lower, below = bound, count
    raise AssertionError("unreachable: the +Inf bucket holds every observation")


def assert_all_answered(replies: list[Reply]) -> None:
    failed = [(r.prompt.id, r.status, r.body) for r in replies if r.status != 200]
    assert not failed, f"{len(failed)} of {len(replies)} requests failed: {failed}"


def fallbacks(metrics: Metrics) -> float:
    return metrics.total("specd_controller_fallbacks_total")


def test_worker_fails_open_when_the_controller_dies_and_recovers_when_it_returns(stack: Stack) -> None:
    controller = stack.start_controller()
    address = controller.address
    worker = stack.start_worker(address, decide_deadline_ms=DEADLINE_MS)
    prompts = mixed_workload(8)
    warm, load, after = prompts[:5], prompts[5:25], prompts[25:]
    outage = prompts * 4  # short requests, so that p99 of the decisions is not just the slowest one
    replies: list[Reply] = []

    with httpx.Client(base_url=worker.url, timeout=120) as http:

        def send(prompt: Prompt) -> Reply:
            return complete(http, prompt, MAX_TOKENS)

        # the worker learns a decision per segment (its fallback when the controller is gone)
        replies += in_threads(send, warm, THREADS)
        wait_for_reports(address, http)

        # 1. SIGKILL the controller in the middle of concurrent load
        with ThreadPoolExecutor(max_workers=THREADS) as pool:
            futures = [pool.submit(send, p) for p in load]
            wait_until(lambda: sum(f.done() for f in futures) >= 4, 60, "the first replies under load")
            controller.kill()
            killed_at = time.monotonic()
            at_kill = Metrics.scrape(http)
            under_load = [f.result() for f in futures]
        replies += under_load
        # 2. more requests while it stays down: every decision here is made without it
        replies += in_threads(lambda p: complete(http, p, OUTAGE_TOKENS), outage, THREADS)
        down = Metrics.scrape(http)
        assert_all_answered(replies)

        after_kill = [r for r in replies if r.sent > killed_at]
        assert len(after_kill) >= len(outage)
        assert all(r.specd["fallback"] in ("unavailable", "timeout") for r in after_kill), [
            (r.specd["fallback"], r.specd["decision_source"]) for r in after_kill
        ]
        assert {r.specd["decision_source"] for r in after_kill} <= {"last_decision", "local_default"}
        assert fallbacks(down) >= len(after_kill)
        outage_rounds = sum(r.specd["num_rounds"] for r in after_kill)
        assert outage_rounds > 0  # their reports wait in the worker's buffer

        decide = histogram_delta(at_kill, down, "specd_decide_seconds")
        (p50, p50_bound), (p99, p99_bound) = quantile(decide, 0.5), quantile(decide, 0.99)
        n = decide[-1][1]
        over_deadline = n - next(c for bound, c in decide if bound == DEADLINE_MS / 1000)
        print(
            f"\ndecide latency with the controller killed ({n:.0f} decisions, deadline {DEADLINE_MS:g} ms): "
            f"p50 {p50 * 1e3:.2f} ms (bucket <= {p50_bound * 1e3:g} ms), "
            f"p99 {p99 * 1e3:.2f} ms (bucket <= {p99_bound * 1e3:g} ms), {over_deadline:.0f} over the deadline; "
            "cumulative buckets " + ", ".join(f"<={bound * 1e3:g}ms: {count:.0f}" for bound, count in decide)
        )
        assert n >= len(outage)
        # The deadline is honoured: nothing waits for the dead controller. The worker's decide time also holds the
        # hop to a thread and back, which on an oversubscribed CPU (2 cores, a training job beside) reaches tens of
        # milliseconds now and then: hence 100 ms for p99, still far from what waiting on a dead peer costs.
        assert p50_bound <= DEADLINE_MS / 1000 and p99_bound <= 0.1, decide

        # 3. restart on the same port with the same state_dir: the orphaned embedded Redis is stopped
        pid_file = stack.controller_state / "redis" / PID_FILE
        orphan = int(pid_file.read_text())
        assert _running(orphan), "a SIGKILLed controller leaves its embedded Redis running"
        restarted = stack.start_controller(listen=address)
        assert restarted.address == address
        assert not _running(orphan), "the restart left the orphaned Redis running"
        assert int(pid_file.read_text()) != orphan

        # decisions come from the controller again (the client reconnects within its backoff)
        resumed: list[Reply] = []

        def answered_by_controller() -> bool:
            resumed.append(send(after[len(resumed) % len(after)]))
            return resumed[-1].specd["decision_source"] == "controller"

        wait_until(answered_by_controller, 30, "a decision from the restarted controller", every_s=0.1)
        replies += resumed
        # the reports buffered during the outage arrive: the controller counts every round the worker decoded
        final = wait_for_reports(address, http, timeout_s=60)

    statuses = [r.status for r in replies]
    print(
        f"requests: {statuses.count(200)}/{len(statuses)} answered 200 ({len(after_kill)} while the controller was "
        f"down); fallbacks counted by the worker: {fallbacks(final):.0f}"
    )
    assert_all_answered(replies)
    assert final.total("specd_requests_total") == len(replies)
    assert fallbacks(final) > 0
