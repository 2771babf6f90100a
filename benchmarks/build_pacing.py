"""Decide beside a refresh's table builds, in-process, side by side: the tables computed with their pacer called
between tables only, against between a table's draws too (``segment_table``'s ``pace``, what a refresh's build
does), and against no build at all. Each segment's window is filled in a real Redis and learned by a real learner.

A call is what a Decide does to the interpreter: it is urgent (``URGENT.serving``) and crosses threads three times
(the event loop to the handler pool and back), each crossing a ``Controller.decide`` on the other thread. Python hands
the interpreter to a thread that wants it only after the switch interval (1 ms, the daemon's), so bulk work that does
not stop for the call delays it at every crossing. Prints each mode's p50 and p99 per run, and the p99 ratios (median
and range over the runs).

    python benchmarks/build_pacing.py [--segments 100] [--runs 3] [--seconds 6] [--redis-url redis://127.0.0.1:6379/0]
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.decay_recount import window_store  # noqa: E402
from controller.decision.core import Controller  # noqa: E402
from controller.decision.decide import Request  # noqa: E402
from controller.decision.learner import Learner  # noqa: E402
from controller.decision.policy import PolicyStore, parse_policy  # noqa: E402
from controller.pacing import URGENT, Pacer, no_pause  # noqa: E402
from controller.serving.table_publisher import segment_table  # noqa: E402
from controller.storage.journal import Journal  # noqa: E402
from controller.storage.store import TelemetryStore  # noqa: E402

DRAFTERS = ("draft", "prompt_lookup")
CROSSINGS = 3
CALL_GAP_S = 0.01  # a steady client's pace: 100 calls a second
SWITCH_INTERVAL_S = 0.001  # the daemon's (controller/server.py)
MODES = ("idle", "between_tables", "between_draws")


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Calls:
    """Urgent calls that cross to a handler thread and back ``CROSSINGS`` times."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._inbox: queue.Queue[tuple[Callable[[], object], queue.Queue[object]]] = queue.Queue()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            work, out = self._inbox.get()
            out.put(work())

    def one(self, segment: str) -> float:
        started = time.perf_counter()
        with URGENT.serving():
            for _ in range(CROSSINGS):
                out: queue.Queue[object] = queue.Queue()
                self._inbox.put((lambda: self.controller.decide(Request(segment, 1, DRAFTERS, 128)), out))
                out.get()
        return time.perf_counter() - started


def measure(controller: Controller, calls: Calls, mode: str, seconds: float) -> list[float]:
    """The calls' latencies over ``seconds`` while a thread computes every segment's table over and over (none for
    "idle"), its pacer called between tables, and between draws for "between_draws"."""
    stop = threading.Event()
    segments = controller.learner.segments()

    def build() -> None:
        while not stop.is_set():
            pace = Pacer()
            within = pace if mode == "between_draws" else no_pause
            for segment in segments:
                pace()
                segment_table(controller, segment, DRAFTERS, pace=within)
                if stop.is_set():
                    return

    builder = threading.Thread(target=build, daemon=True) if mode != "idle" else None
    if builder is not None:
        builder.start()
    latencies, end = [], time.perf_counter() + seconds
    while time.perf_counter() < end:
        latencies.append(calls.one(segments[len(latencies) % len(segments)]))
        time.sleep(CALL_GAP_S)
    stop.set()
    if builder is not None:
        builder.join()
    return latencies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segments", type=int, default=100)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=6.0, help="each mode's calls, per run")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    p50: dict[str, list[float]] = {m: [] for m in MODES}
    p99: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        with window_store(args.redis_url, "build-pacing", args.segments) as (client, config, start):
            store = TelemetryStore(client, config, lambda: start + 10.0)
            journal = Journal(Path(tempfile.mkdtemp()) / "journal.jsonl", 1000)
            learner = Learner(store, journal, lambda: start + 10.0, prior_retrain_seconds=1e9)
            learner.refresh()
            controller = Controller(learner, PolicyStore(parse_policy("{}")))
            calls = Calls(controller)
            for run in range(args.runs):
                for mode in MODES:  # interleaved: the machine's drift falls on every mode alike
                    latencies = measure(controller, calls, mode, args.seconds)
                    p50[mode].append(percentile(latencies, 0.50) * 1000)
                    p99[mode].append(percentile(latencies, 0.99) * 1000)
                    print(f"run {run + 1} {mode:>14}: {len(latencies)} calls, p50 {p50[mode][-1]:.2f} ms, "
                          f"p99 {p99[mode][-1]:.2f} ms", flush=True)  # fmt: skip
    finally:
        sys.setswitchinterval(interval)
    tables_over_draws = sorted(t / d for t, d in zip(p99["between_tables"], p99["between_draws"], strict=True))
    draws_over_idle = sorted(d / i for d, i in zip(p99["between_draws"], p99["idle"], strict=True))
    result = {
        "segments": args.segments, "runs": args.runs, "crossings": CROSSINGS,
        **{f"{m}_p50_ms": statistics.median(p50[m]) for m in MODES},
        **{f"{m}_p99_ms": statistics.median(p99[m]) for m in MODES},
        "p99_between_tables_over_between_draws": statistics.median(tables_over_draws),
        "tables_over_draws_min": tables_over_draws[0], "tables_over_draws_max": tables_over_draws[-1],
        "p99_between_draws_over_idle": statistics.median(draws_over_idle),
        "draws_over_idle_min": draws_over_idle[0], "draws_over_idle_max": draws_over_idle[-1],
    }  # fmt: skip
    print(f"{args.segments} segments, {args.runs} runs: a call's p99 beside builds paced between tables "
          f"{result['between_tables_p99_ms']:.2f} ms, between draws {result['between_draws_p99_ms']:.2f} ms, idle "
          f"{result['idle_p99_ms']:.2f} ms; tables/draws {result['p99_between_tables_over_between_draws']:.2f}x "
          f"[{tables_over_draws[0]:.2f}, {tables_over_draws[-1]:.2f}], draws/idle "
          f"{result['p99_between_draws_over_idle']:.2f}x "
          f"[{draws_over_idle[0]:.2f}, {draws_over_idle[-1]:.2f}]")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
