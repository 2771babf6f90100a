"""Sending the demo's traffic and adding it up.

``plan`` picks the prompts (round-robin over segments, each prompt for both workers, the first one rotating; every
AA_EVERY-th prompt of a segment also for the A/A: the adaptive worker under ``aa/<segment>``, where the controller
answers no speculation); ``Driver`` sends them over HTTP from a few threads and collects a ``Result`` per response;
``summarize`` turns results into one ``SegmentRow`` per segment, ``aa_figure`` the A/A's. Everything but ``Driver`` is
a pure function.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from specd.demo.configs import AA_PREFIX
from workloads import Prompt

ADAPTIVE, BASELINE, AA = "adaptive", "baseline", "aa"
ARMS = (ADAPTIVE, BASELINE)
SEGMENT_ORDER = ("code", "prose", "structured", "extractive", "adversarial")
AA_EVERY = 3  # every third prompt of a segment is sent for the A/A too


@dataclass(frozen=True)
class Request:
    """One prompt, sent to the workers in ``order`` (the adaptive one, the baseline, and for some the A/A: the
    adaptive worker with speculation off)."""

    prompt: Prompt
    max_tokens: int
    seed: int
    order: tuple[str, ...]


@dataclass(frozen=True)
class Result:
    """One worker's answer to one prompt (or why there was none)."""

    prompt_id: str
    segment: str
    arm: str
    ok: bool
    error: str | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    drafter: str = "none"
    k: int = 0  # the plan's K ceiling
    decision_reason: str = ""
    decision_source: str = ""
    exploration: bool = False
    fallback: str | None = None
    proposed: int = 0  # draft tokens proposed over the request's rounds
    accepted: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    seconds: float = 0.0  # the HTTP call, as the client saw it


@dataclass(frozen=True)
class SegmentRow:
    """What the table shows for one segment (or for all of them)."""

    segment: str
    total: int  # requests planned (prompts x 2 workers)
    done: int  # requests answered, failed ones included
    failures: int
    proposed: int
    accepted: int
    drafter: str | None  # the latest decision the controller made (not a probe), None before any
    k: int | None
    decision_source: str | None
    explored: int  # adaptive requests that were probes
    decided: int  # adaptive requests answered
    pairs: int  # prompts both workers answered: what the tokens/s compare
    tokens_per_second_adaptive: float | None
    tokens_per_second_baseline: float | None
    median_pair_speedup: float | None  # the median over prompts of adaptive / baseline: robust to CPU hiccups
    median_pair_interval: tuple[float, float] | None = None  # its bootstrap 95 % interval (the final summary's)

    @property
    def alpha(self) -> float | None:
        """α = accepted / proposed over the adaptive worker's requests."""
        return self.accepted / self.proposed if self.proposed else None

    @property
    def speedup(self) -> float | None:
        """Decode tokens/s of the adaptive worker over the baseline's, on the same prompts."""
        a, b = self.tokens_per_second_adaptive, self.tokens_per_second_baseline
        return a / b if a is not None and b else None


# -- planning -----------------------------------------------------------------------------------------------


def segment_order(segments: Iterable[str]) -> list[str]:
    """The README's order for the shipped segments, any others after them by name."""
    known = {name: i for i, name in enumerate(SEGMENT_ORDER)}
    return sorted(segments, key=lambda s: (known.get(s, len(known)), s))


def plan(workloads: Mapping[str, Sequence[Prompt]], per_segment: int, max_tokens: int, seed: int) -> list[Request]:
    """``per_segment`` prompts of each segment (a seeded sample; repeated when the segment has fewer),
    interleaved round-robin so that the controller learns every segment at once. Within a segment the worker
    that goes first rotates, so every arm sees the same machine noise; every AA_EVERY-th prompt goes to the A/A
    arm too."""
    if per_segment < 1 or max_tokens < 1:
        raise ValueError("per_segment and max_tokens must be >= 1")
    rng = random.Random(seed)
    chosen: dict[str, list[Prompt]] = {}
    for segment in segment_order(workloads):
        prompts = list(workloads[segment])
        if not prompts:
            continue
        picked: list[Prompt] = []
        while len(picked) < per_segment:
            picked.extend(rng.sample(prompts, min(len(prompts), per_segment - len(picked))))
        chosen[segment] = picked
    requests: list[Request] = []
    for i in range(per_segment):
        for j, prompts in enumerate(chosen.values()):
            prompt = prompts[i]
            arms = (*ARMS, AA) if i % AA_EVERY == 0 else ARMS
            shift = (i + j) % len(arms)
            order = arms[shift:] + arms[:shift]
            sampling_seed = seed * 1_000_003 + len(requests)
            requests.append(Request(prompt, min(prompt.max_new_tokens, max_tokens), sampling_seed, order))
    return requests


def request_body(request: Request, arm: str = "") -> dict[str, Any]:
    """The A/A arm's requests name ``aa/SEGMENT``, which the demo's policy forces to no speculation: the adaptive
    worker then runs its whole control path and decodes plainly, beside the baseline, which has no controller."""
    p = request.prompt
    return {
        "prompt": p.prompt,
        "max_tokens": request.max_tokens,
        "temperature": p.temperature,
        "seed": request.seed,
        "segment": AA_PREFIX + p.segment if arm == AA else p.segment,
    }


# -- one response -------------------------------------------------------------------------------------------


def parse_response(status: int, body: Any, request: Request, arm: str, seconds: float) -> Result:
    """A worker's answer as a ``Result``; anything but a 200 with a ``specd`` block is a failure."""
    p = request.prompt
    if status != 200 or not isinstance(body, dict) or not isinstance(body.get("specd"), dict):
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        error = f"HTTP {status}: {message if message else repr(body)}"[:200]
        return Result(p.id, p.segment, arm, ok=False, error=error, seconds=seconds)
    info = body["specd"]
    return Result(
        prompt_id=p.id,
        segment=p.segment,
        arm=arm,
        ok=True,
        completion_tokens=int(body.get("usage", {}).get("completion_tokens", 0)),
        prompt_tokens=int(body.get("usage", {}).get("prompt_tokens", 0)),
        drafter=str(info.get("drafter", "none")),
        k=int(info.get("k", 0)),
        decision_reason=str(info.get("decision_reason", "")),
        decision_source=str(info.get("decision_source", "")),
        exploration=bool(info.get("exploration", False)),
        fallback=info.get("fallback"),
        proposed=int(info.get("num_drafted", 0)),
        accepted=int(info.get("num_accepted", 0)),
        prefill_seconds=float(info.get("prefill_seconds", 0.0)),
        decode_seconds=float(info.get("decode_seconds", 0.0)),
        seconds=seconds,
    )


def send(client: httpx.Client, url: str, request: Request, arm: str) -> Result:
    started = time.perf_counter()
    try:
        response = client.post(f"{url}/v1/completions", json=request_body(request, arm))
        body = response.json()
        status = response.status_code
    except (httpx.HTTPError, ValueError) as e:
        p = request.prompt
        return Result(p.id, p.segment, arm, ok=False, error=f"{type(e).__name__}: {e}"[:200],
                      seconds=time.perf_counter() - started)  # fmt: skip
    return parse_response(status, body, request, arm, time.perf_counter() - started)


# -- adding up ----------------------------------------------------------------------------------------------


def decode_rate(results: Iterable[Result]) -> float | None:
    """Decode tokens/s over a set of answers: all their tokens over all their decode time."""
    tokens = seconds = 0.0
    for r in results:
        tokens += r.completion_tokens
        seconds += r.decode_seconds
    return tokens / seconds if seconds > 0 else None


def pair_ratios(pairs: Sequence[tuple[Result, Result]]) -> list[float]:
    """Per prompt: (the first's decode tokens/s) / (the second's)."""
    ratios = []
    for first, second in pairs:
        a, b = decode_rate([first]), decode_rate([second])
        if a is not None and b:
            ratios.append(a / b)
    return ratios


def median_ratio(pairs: Sequence[tuple[Result, Result]]) -> float | None:
    """The median over prompts of (adaptive decode tokens/s) / (baseline decode tokens/s)."""
    ratios = pair_ratios(pairs)
    return statistics.median(ratios) if ratios else None


def interval(ratios: Sequence[float]) -> tuple[float, float] | None:
    """The bootstrap 95 % interval of the median of ``ratios`` (specd.bench.measure's, seeded)."""
    from specd.bench.measure import PromptRatio, bootstrap
    from specd.bench.measure import median_ratio as median_of

    if not ratios:
        return None
    return bootstrap([PromptRatio((0, "", str(i)), r, 1) for i, r in enumerate(ratios)], median_of)


def paired(results: Sequence[Result], first: str, second: str) -> list[tuple[Result, Result]]:
    """(``first``'s answer, ``second``'s) for every prompt both answered, in arrival order of the prompts."""
    answered: dict[str, dict[str, Result]] = {}
    for r in results:
        if r.ok:
            answered.setdefault(r.prompt_id, {})[r.arm] = r
    return [(both[first], both[second]) for both in answered.values() if first in both and second in both]


@dataclass(frozen=True)
class Figure:
    """A paired median over prompts, its interval, and the prompts behind it."""

    median: float | None
    interval: tuple[float, float] | None
    pairs: int


def aa_figure(results: Sequence[Result]) -> Figure:
    """The A/A: the adaptive worker with speculation off (its aa/* requests) over the baseline, per prompt."""
    ratios = pair_ratios(paired(results, AA, BASELINE))
    return Figure(statistics.median(ratios) if ratios else None, interval(ratios), len(ratios))


# A decision's source (``specd_api.plan.Source``) that is the controller's answer: over Decide, or from its tables.
CONTROLLER_SOURCES = ("controller", "table")
REQUEST_SOURCE = "request"  # the request fixed its own plan (a seeded sampled request: no speculation)


def summarize_segment(segment: str, total: int, results: Sequence[Result], intervals: bool = False) -> SegmentRow:
    """One row from the results of one segment (or of all, for the overall row), in arrival order; with
    ``intervals``, the median pair speedup's bootstrap interval too (the final summary: too much work for the live
    table, which runs beside the decodes it measures)."""
    adaptive = [r for r in results if r.arm == ADAPTIVE and r.ok]
    pairs = [{ADAPTIVE: a, BASELINE: b} for a, b in paired(results, ADAPTIVE, BASELINE)]
    latest = next(
        (r for r in reversed(adaptive) if not r.exploration and r.decision_source in CONTROLLER_SOURCES), None
    )
    latest = latest or next((r for r in reversed(adaptive) if not r.exploration), None)
    return SegmentRow(
        segment=segment,
        total=total,
        done=len(results),
        failures=sum(not r.ok for r in results),
        proposed=sum(r.proposed for r in adaptive),
        accepted=sum(r.accepted for r in adaptive),
        drafter=latest.drafter if latest else None,
        k=latest.k if latest else None,
        decision_source=latest.decision_source if latest else None,
        explored=sum(r.exploration for r in adaptive),
        decided=len(adaptive),
        pairs=len(pairs),
        tokens_per_second_adaptive=decode_rate(both[ADAPTIVE] for both in pairs),
        tokens_per_second_baseline=decode_rate(both[BASELINE] for both in pairs),
        median_pair_speedup=median_ratio([(both[ADAPTIVE], both[BASELINE]) for both in pairs]),
        median_pair_interval=interval(pair_ratios([(b[ADAPTIVE], b[BASELINE]) for b in pairs])) if intervals else None,
    )


def summarize(
    totals: Mapping[str, int], results: Sequence[Result], intervals: bool = False
) -> tuple[list[SegmentRow], SegmentRow]:
    """A row per segment of ``totals`` (requests planned per segment), and the overall row."""
    by_segment: dict[str, list[Result]] = {segment: [] for segment in totals}
    for r in results:
        by_segment.setdefault(r.segment, []).append(r)
    rows = [summarize_segment(s, totals.get(s, 0), rs, intervals) for s, rs in by_segment.items()]
    overall = summarize_segment("all", sum(totals.values()), results, intervals)
    return rows, overall


def totals_of(requests: Sequence[Request]) -> dict[str, int]:
    """Requests planned per segment, in plan order (each prompt to every arm of its order)."""
    totals: dict[str, int] = {}
    for r in requests:
        totals[r.prompt.segment] = totals.get(r.prompt.segment, 0) + len(r.order)
    return totals


def traffic_lengths(results: Sequence[Result]) -> dict[str, tuple[int, int]]:
    """Per segment, the median (new tokens, prompt tokens) of the adaptive worker's answers: the request the final
    table's expected speedups are made for."""
    out: dict[str, tuple[int, int]] = {}
    for segment in dict.fromkeys(r.segment for r in results):
        mine = [r for r in results if r.segment == segment and r.arm == ADAPTIVE and r.ok]
        if mine:
            out[segment] = (round(statistics.median(r.completion_tokens for r in mine)),
                            round(statistics.median(r.prompt_tokens for r in mine)))  # fmt: skip
    return out


# -- sending ------------------------------------------------------------------------------------------------


class Driver:
    """Sends the plan from ``concurrency`` threads (each one prompt at a time, to both workers in its order)
    and keeps the results. ``stop`` lets the threads finish the request they are in, then end."""

    def __init__(self, urls: Mapping[str, str], requests: Sequence[Request], concurrency: int = 1,
                 timeout_seconds: float = 300.0) -> None:  # fmt: skip
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        self.urls, self.requests = dict(urls), list(requests)
        self.concurrency, self.timeout_seconds = concurrency, timeout_seconds
        self._results: list[Result] = []
        self._next = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._work, name=f"demo-driver-{i}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stopping.set()

    def join(self, timeout_seconds: float) -> bool:
        """Waits for the threads; True when all have ended."""
        deadline = time.monotonic() + timeout_seconds
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        return not self.running

    @property
    def running(self) -> bool:
        return any(thread.is_alive() for thread in self._threads)

    def results(self) -> list[Result]:
        with self._lock:
            return list(self._results)

    def _take(self) -> Request | None:
        with self._lock:
            if self._stopping.is_set() or self._next >= len(self.requests):
                return None
            self._next += 1
            return self.requests[self._next - 1]

    def _work(self) -> None:
        with httpx.Client(timeout=self.timeout_seconds) as client:
            while (request := self._take()) is not None:
                for arm in request.order:
                    if self._stopping.is_set():
                        return
                    result = send(client, self.urls[arm], request, arm)
                    with self._lock:
                        self._results.append(result)


def fallback_counts(results: Iterable[Result]) -> dict[str, int]:
    """Adaptive requests decided without the controller's answer for them, by cause (timeout, unavailable …)."""
    counts: dict[str, int] = {}
    for r in results:
        if r.ok and r.arm == ADAPTIVE and r.fallback:
            counts[r.fallback] = counts.get(r.fallback, 0) + 1
    return counts
