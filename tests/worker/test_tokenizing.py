"""The tokenizing lanes: a host's job waits for at most one job of each other host, a small prompt never waits
behind a large one, a job whose request went away is not run, and a job's error reaches its request. (Over a
running worker: tests/worker/test_limits.py.)"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from decoder.worker.tokenizing import SMALL_PROMPT_CHARS, FairLane, Tokenizing


def gate_job(ran: list[str], name: str, gate: threading.Event | None = None):
    def work() -> list[int]:
        if gate is not None:
            assert gate.wait(10)
        ran.append(name)
        return [len(ran)]

    return work


def test_hosts_take_turns() -> None:
    async def scenario() -> list[str]:
        ran: list[str] = []
        gate = threading.Event()
        lane: FairLane[list[int]] = FairLane(ThreadPoolExecutor(1))
        first = asyncio.ensure_future(lane.run("flood", gate_job(ran, "flood-1", gate)))
        await asyncio.sleep(0.05)  # flood-1 runs and holds the lane
        jobs = [asyncio.ensure_future(lane.run("flood", gate_job(ran, f"flood-{i}"))) for i in range(2, 5)]
        jobs.append(asyncio.ensure_future(lane.run("other", gate_job(ran, "other-1"))))
        jobs.append(asyncio.ensure_future(lane.run("third", gate_job(ran, "third-1"))))
        gate.set()
        await asyncio.gather(first, *jobs)
        return ran

    # the hosts that waited unserved go before the flood's next
    assert asyncio.run(scenario()) == ["flood-1", "other-1", "third-1", "flood-2", "flood-3", "flood-4"]


def test_a_small_prompt_does_not_wait_for_a_large_one() -> None:
    async def scenario() -> None:
        ran: list[str] = []
        gate = threading.Event()
        lanes = Tokenizing()
        large = asyncio.ensure_future(lanes.run(SMALL_PROMPT_CHARS + 1, "flood", gate_job(ran, "large", gate)))
        await asyncio.sleep(0.05)
        small = await asyncio.wait_for(lanes.run(SMALL_PROMPT_CHARS, "flood", gate_job(ran, "small")), 5)
        assert small == [1] and ran == ["small"] and not large.done()
        gate.set()
        assert await large == [2]

    asyncio.run(scenario())


def test_a_job_whose_request_went_away_is_not_run_and_errors_reach_their_request() -> None:
    async def scenario() -> list[str]:
        ran: list[str] = []
        gate = threading.Event()
        lane: FairLane[list[int]] = FairLane(ThreadPoolExecutor(1))
        first = asyncio.ensure_future(lane.run("a", gate_job(ran, "first", gate)))
        await asyncio.sleep(0.05)
        gone = asyncio.ensure_future(lane.run("b", gate_job(ran, "gone")))
        await asyncio.sleep(0.01)
        gone.cancel()

        def fails() -> list[int]:
            raise ValueError("bad prompt")

        failing = asyncio.ensure_future(lane.run("c", fails))
        gate.set()
        await first
        with pytest.raises(ValueError, match="bad prompt"):
            await failing
        assert await lane.run("d", gate_job(ran, "after")) == [2]  # the lane goes on
        return ran

    assert asyncio.run(scenario()) == ["first", "after"]
