"""`specd bench`, in order: start the controller (embedded Redis, fresh state) and two workers on the reference pair,
the same models and settings: the controlled one, which asks the controller (the adaptive arms), and the uncontrolled
one, which has no controller at all (every static arm, ``none`` included: the worker a user compares with) -> ask
which drafters they offer -> pass 1: every prompt through every static arm offered and the adaptive arm (the
controller starting cold), interleaved -> pass 2: the same prompts again, adaptive (warm) beside none -> the A/A
pass: every prompt through the controlled worker with every decision ``none`` (its aa/* segments) beside the
uncontrolled worker's none (specd.bench.aa) -> optional batch sweep and drift scenario -> stop the services; with
``--repeats N``, the passes again in N - 1 more runs, each with fresh services in its own folder (the batch sweep and
drift scenario run in the first only) -> measure the engine's costs alone -> bench.json, BENCH.md, plots.

Static arms name their drafter and K in the request (``speculation``) on the uncontrolled worker, so the controller
learns from the adaptive arm's traffic only and its costs are its own measurements.

Every arm decodes the same prompts, so no measured request shares its output (``share_outputs: false``): suffix
decoding would otherwise propose a prompt's own output back to the arms that follow it. Its cache holds the outputs of
held-out prompts of each segment instead (``PRIMERS_PER_SEGMENT``, decoded once before the passes): the same cache
for every arm and both passes, and the traffic a worker would have served the segment before.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from controller.storage.redis_conn import PID_FILE, stop_orphan
from specd.bench.measure import (
    AA_CONTROLLED,
    AA_UNCONTROLLED,
    ADAPTIVE,
    ADAPTIVE_WARM,
    NONE,
    STATIC_ARMS,
    WARM_BASELINE,
    Sample,
    parse_arm,
    static_arms,
)
from specd.bench.noise import StallNoise, worker_seed
from specd.demo.configs import (
    AA_PREFIX,
    DemoPaths,
    controller_config,
    uncontrolled_worker_config,
    with_off_rule,
    worker_config,
    write_config,
)
from specd.demo.run import prepare_run_folder
from specd.launch import LaunchError, Service, start
from specd_api.errors import SpecdError
from workloads import Prompt, load_workload

MARKER = ".specd-bench"


class BenchError(SpecdError):
    """The bench cannot run (a service did not start, a bad workload, a run folder it will not wipe)."""


@dataclass(frozen=True)
class BenchOptions:
    workloads: tuple[Path, ...]
    out: Path
    prompts_per_segment: int
    max_new_tokens: int
    dtype: str
    repeats: int
    batches: tuple[int, ...]
    drift: bool
    target: Path
    draft: Path
    policy: Path
    head: Path | None = None  # a draft head: the worker offers eagle
    seed: int = 0
    noise: StallNoise | None = None  # stalls the worker puts into its own rounds (--noise)


@dataclass
class Run:
    """Everything measured, for the report."""

    samples: list[Sample] = field(default_factory=list)
    arms: tuple[str, ...] = STATIC_ARMS  # the static arms the worker offered (and the bench ran)
    batch: dict[str, dict[str, float]] = field(default_factory=dict)  # batch size -> arm -> tokens/s
    batch_decisions: dict[str, dict[str, int]] = field(default_factory=dict)  # batch size -> drafter -> requests
    drift: dict[str, Any] = field(default_factory=dict)
    learned_costs: dict[str, Any] = field(default_factory=dict)
    isolated_costs: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


def load_prompts(files: Sequence[Path], per_segment: int, seed: int) -> dict[str, list[Prompt]]:
    """``per_segment`` prompts of each segment found in ``files`` (a seeded sample, in file order when all)."""
    segments: dict[str, list[Prompt]] = {}
    for path in files:
        try:
            for prompt in load_workload(path):
                segments.setdefault(prompt.segment, []).append(prompt)
        except (OSError, ValueError) as e:
            raise BenchError(f"--workload {path}: {e}") from None
    if not segments:
        raise BenchError("the workloads hold no prompts")
    rng = random.Random(seed)
    return {s: (ps if len(ps) <= per_segment else rng.sample(ps, per_segment)) for s, ps in segments.items()}


PRIMERS_PER_SEGMENT = 12


def held_out(files: Sequence[Path], chosen: dict[str, list[Prompt]], count: int) -> list[Prompt]:
    """Up to ``count`` prompts of each chosen segment that the bench does not measure (file order), interleaved."""
    measured = {p.id for ps in chosen.values() for p in ps}
    rest: dict[str, list[Prompt]] = {}
    for path in files:
        for prompt in load_workload(path):
            if prompt.segment in chosen and prompt.id not in measured and len(rest.get(prompt.segment, [])) < count:
                rest.setdefault(prompt.segment, []).append(prompt)
    return interleaved(rest) if rest else []


def prime(client: httpx.Client, urls: Workers, primers: Sequence[Prompt], max_new_tokens: int) -> None:
    """Serve ``primers`` once on each worker, sharing their outputs: what the suffix cache of each segment holds
    while measured (the same on both workers: their outputs are the target's)."""
    for url in (urls.controlled, urls.uncontrolled):
        for prompt in primers:
            request = {**body(prompt, NONE, max_new_tokens), "share_outputs": True}
            response = client.post(f"{url}/v1/completions", json=request)
            if response.status_code != 200:
                raise BenchError(f"priming with {prompt.id}: HTTP {response.status_code}: {response.text[:200]}")


@dataclass(frozen=True)
class Workers:
    """The two workers' URLs: the controlled one serves the adaptive arms (and the A/A pass's controlled side), the
    uncontrolled one every static arm."""

    controlled: str
    uncontrolled: str

    def for_arm(self, arm: str) -> str:
        return self.controlled if arm in (ADAPTIVE, ADAPTIVE_WARM, AA_CONTROLLED) else self.uncontrolled


def interleaved(prompts: dict[str, list[Prompt]]) -> list[Prompt]:
    """Round-robin over the segments, so that the controller learns every segment at once."""
    order: list[Prompt] = []
    for i in range(max(map(len, prompts.values()))):
        order += [ps[i] for ps in prompts.values() if i < len(ps)]
    return order


def body(prompt: Prompt, arm: str, max_new_tokens: int, segment: str | None = None) -> dict[str, Any]:
    request: dict[str, Any] = {
        "prompt": prompt.prompt,
        "max_tokens": min(prompt.max_new_tokens, max_new_tokens),
        "temperature": prompt.temperature,
        "seed": 1234,  # the same for every arm: sampled arms differ only by speculation
        "segment": segment or prompt.segment,
        "share_outputs": False,  # every arm decodes this prompt: none may propose its output to another
    }
    if arm == AA_CONTROLLED:
        request["segment"] = f"{AA_PREFIX}{segment or prompt.segment}"  # the controller answers none there
    elif arm not in (ADAPTIVE, ADAPTIVE_WARM):
        drafter, k = parse_arm(arm)
        request["speculation"] = {"drafter": drafter, "k": k, "report": False}
    return request


def send(client: httpx.Client, urls: Workers, prompt: Prompt, arm: str, options: BenchOptions, order: int,
         segment: str | None = None, run: int = 0) -> Sample:  # fmt: skip
    url = urls.for_arm(arm)
    response = client.post(f"{url}/v1/completions", json=body(prompt, arm, options.max_new_tokens, segment))
    if response.status_code != 200:
        raise BenchError(f"{arm} on {prompt.id}: HTTP {response.status_code}: {response.text[:200]}")
    answer = response.json()
    info = answer["specd"]
    return Sample(
        arm=arm,
        segment=segment or prompt.segment,
        prompt_id=prompt.id,
        tokens=int(answer["usage"]["completion_tokens"]),
        decode_seconds=float(info.get("decode_seconds", 0.0)),
        greedy=prompt.temperature == 0,
        text=answer["choices"][0]["text"],
        drafter=str(info.get("drafter", "none")),
        k=int(info.get("k", 0)),
        mean_k=float(info.get("mean_k", 0.0)),
        exploration=bool(info.get("exploration", False)),
        order=order,
        reason=str(info.get("decision_reason", "")),
        expected_speedup=float(info.get("expected_speedup", 1.0)),
        run=run,
        ttft_seconds=float(info.get("ttft_seconds", 0.0)),
    )


def offered_drafters(client: httpx.Client, urls: Workers, prompt: Prompt) -> tuple[str, ...]:
    """The drafters the worker runs, asked of the worker itself: a short request per drafter of the static arms, named
    in the request (not reported). A drafter it does not offer is refused (422) or replaced by none (no round ran
    with K > 0)."""
    offered = []
    for drafter in dict.fromkeys(parse_arm(arm)[0] for arm in STATIC_ARMS if arm != NONE):
        request = {"prompt": prompt.prompt, "max_tokens": 8, "temperature": 0.0, "segment": prompt.segment,
                   "speculation": {"drafter": drafter, "k": 2, "report": False}, "share_outputs": False}  # fmt: skip
        response = client.post(f"{urls.uncontrolled}/v1/completions", json=request)
        if response.status_code == 200 and float(response.json().get("specd", {}).get("mean_k", 0.0)) > 0:
            offered.append(drafter)
    return tuple(offered)


def run_bench(options: BenchOptions, console: Console) -> int:
    prompts = load_prompts(options.workloads, options.prompts_per_segment, options.seed)
    top = DemoPaths(options.out)
    prepare_run_folder(top, "bench", BenchError, MARKER)
    run = Run()
    started = time.monotonic()
    order = interleaved(prompts)
    per_run = len(order) * (len(STATIC_ARMS) + 1) + 4 * len(order)  # pass 1; pass 2 and the A/A pass, in pairs
    total = per_run * options.repeats + sum(4 * b * max(1, 8 // b) for b in options.batches if b > 1)
    total += 2 * DRIFT_PROMPTS if options.drift else 0
    with progress_bar(console, total) as advance:
        for r in range(options.repeats):
            paths = top if options.repeats == 1 else DemoPaths(top.run / f"run-{r + 1}")
            paths.logs.mkdir(parents=True, exist_ok=True)
            if options.repeats > 1:
                console.print(f"run {r + 1} of {options.repeats} (fresh services, {paths.run}) …")
            measure_once(options, prompts, paths, run, r, console, advance)
    console.print("measuring the engine's own costs (no worker, no controller) …")
    from specd.bench.isolated import measure_engine_costs

    run.isolated_costs = asdict(measure_engine_costs(options.target, options.draft, options.dtype, prompts))
    run.seconds = time.monotonic() - started
    from specd.bench.report import write_report

    result = write_report(run, options, top.run)
    console.print(result.text, soft_wrap=True, markup=False)  # the intervals' brackets are not markup
    return 0 if result.summary["outputs_equal"] else 1


def measure_once(options: BenchOptions, prompts: dict[str, list[Prompt]], paths: DemoPaths, run: Run, index: int,
                 console: Console, advance: Callable[[], None]) -> None:  # fmt: skip
    """One run of the measurement on fresh services: the passes; in the first run, the batch sweep, the drift scenario
    and the learned costs too."""
    services: dict[str, Service] = {}
    order = interleaved(prompts)
    try:
        start_services(options, paths, services, console, seed=worker_seed(options.seed, index))
        urls = Workers(services["worker"].url, services["baseline"].url)
        controller = services["controller"].address
        with httpx.Client(timeout=600) as client:
            offered = offered_drafters(client, urls, order[0])
            prime(client, urls, held_out(options.workloads, prompts, PRIMERS_PER_SEGMENT), options.max_new_tokens)
            run.arms = static_arms(offered)
            missing = sorted({parse_arm(arm)[0] for arm in STATIC_ARMS} - {NONE, *offered})
            if missing and index == 0:
                console.print(f"the worker does not offer {', '.join(missing)}: those static arms are left out")
            for _ in range((len(STATIC_ARMS) - len(run.arms)) * len(order)):
                advance()  # the arms the worker does not offer: not run

            def done(sample: Sample) -> None:
                run.samples.append(sample)
                advance()

            passes(client, urls, order, options, run.arms, done, index)
            if index == 0:
                for b in (b for b in options.batches if b > 1):
                    run.batch[str(b)], run.batch_decisions[str(b)] = batch_sweep(urls, order, b, options, advance)
                if options.drift:
                    run.drift = drift_scenario(client, urls, controller, prompts, options, done)
        if index == 0:
            run.learned_costs = fetch_costs(controller)
    except LaunchError as e:
        raise BenchError(str(e).splitlines()[0]) from None
    finally:
        stop(services, paths)


def passes(client: httpx.Client, urls: Workers, order: list[Prompt], options: BenchOptions, statics: Sequence[str],
           done: Callable[[Sample], None], run: int = 0) -> None:  # fmt: skip
    """Pass 1 (every static arm in ``statics``, and adaptive starting cold), pass 2 (adaptive warm beside none) and
    the A/A pass (the controlled worker, every decision none, beside the uncontrolled worker's none)."""
    arms = [*statics, ADAPTIVE]
    for i, prompt in enumerate(order):
        shift = i % len(arms)  # no arm always goes first
        for arm in arms[shift:] + arms[:shift]:
            done(send(client, urls, prompt, arm, options, i, run=run))
    for pair_arms, sent_as in (((ADAPTIVE_WARM, WARM_BASELINE), {WARM_BASELINE: NONE, ADAPTIVE_WARM: ADAPTIVE}),
                               ((AA_CONTROLLED, AA_UNCONTROLLED), {})):  # fmt: skip
        for i, prompt in enumerate(order):
            for arm in pair_arms if i % 2 == 0 else pair_arms[::-1]:
                sample = send(client, urls, prompt, sent_as.get(arm, arm), options, i, run=run)
                done(Sample(**{**asdict(sample), "arm": arm, "segment": prompt.segment}))


BATCH_ARMS = (NONE, "draft:4", "prompt_lookup:8", ADAPTIVE)


def batch_sweep(urls: Workers, order: list[Prompt], b: int, options: BenchOptions,
                tick: Callable[[], None]) -> tuple[dict[str, float], dict[str, int]]:  # fmt: skip
    """``b`` requests at once, per arm in turn (groups of b prompts, repeated so every batch size sends about
    8 groups' worth): tokens/s of the worker (all tokens over the wall time of the group)."""
    groups = [order[(g * b + j) % len(order)] for g in range(max(1, 8 // b)) for j in range(b)]
    rates: dict[str, list[float]] = {arm: [0.0, 0.0] for arm in BATCH_ARMS}
    decisions: dict[str, int] = {}
    with httpx.Client(timeout=600, limits=httpx.Limits(max_connections=b)) as client:
        for g in range(0, len(groups), b):
            for arm in BATCH_ARMS:
                started = time.perf_counter()

                def one(prompt: Prompt, arm: str = arm) -> Sample:
                    return send(client, urls, prompt, arm, options, 0)

                results = at_once(groups[g : g + b], one)
                rates[arm][0] += sum(s.tokens for s in results)
                rates[arm][1] += time.perf_counter() - started
                for s in results:
                    tick()
                    if arm == ADAPTIVE:
                        decisions[s.drafter] = decisions.get(s.drafter, 0) + 1
    return {arm: t / s if s else 0.0 for arm, (t, s) in rates.items()}, decisions


def at_once(prompts: list[Prompt], call: Callable[[Prompt], Sample]) -> list[Sample]:
    """``call`` on every prompt at the same time (one thread each); the answers in prompt order."""
    results: list[Sample | None] = [None] * len(prompts)

    def one(i: int) -> None:
        results[i] = call(prompts[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    missing = [p.id for p, r in zip(prompts, results, strict=True) if r is None]
    if missing:
        raise BenchError(f"requests failed: {', '.join(missing)} (see the worker's log)")
    return [r for r in results if r is not None]


DRIFT_PROMPTS = 24  # per phase
# The second phase's traffic, by the drafter the controller chose in the first: the adversarial prompts, at the
# temperature where that drafter stops paying. Prompt lookup proposes one token, accepted with the target's own
# probability of it, which sampled hot is small; greedy, the target loops and lookup thrives. The draft model is
# the opposite: sampled hot its flat distribution agrees with the target's (draft K = 4 runs 1.0-1.1x), greedy its
# first-position acceptance is about 0.5 and every K is slower than no speculation.
LOW_TEMPERATURE = {"prompt_lookup": 1.0, "draft": 0.0}


def drift_scenario(client: httpx.Client, urls: Workers, controller: str, prompts: dict[str, list[Prompt]],
                   options: BenchOptions, done: Callable[[Sample], None]) -> dict[str, Any]:  # fmt: skip
    """One segment ("drift") whose traffic switches halfway from high to low acceptance for the drafter in use:
    structured records, greedy (where both drafters pay), then the adversarial prompts at the temperature where the
    first phase's drafter does not (``LOW_TEMPERATURE``). It returns the adaptive arm's plan per request, how many
    requests after the switch the controller kept using the first phase's drafter, and the drift alarm."""
    high = [replace(p, temperature=0.0) for p in prompts.get("structured") or next(iter(prompts.values()))]
    adversarial = list(prompts.get("adversarial") or next(iter(prompts.values())))
    timeline: list[dict[str, Any]] = []
    switched_at = time.monotonic()
    low: list[Prompt] = []
    for i in range(2 * DRIFT_PROMPTS):
        late = i >= DRIFT_PROMPTS
        if i == DRIFT_PROMPTS:
            first = switch_point(timeline)["before"]
            low = [replace(p, temperature=LOW_TEMPERATURE.get(first, 0.0)) for p in adversarial]
            switched_at = time.monotonic()
        prompt = low[i % len(low)] if late else high[i % len(high)]
        sample = send(client, urls, prompt, ADAPTIVE, options, i, segment="drift")
        done(Sample(**{**asdict(sample), "arm": "drift"}))
        timeline.append({
            "request": i, "phase": "low" if late else "high", "drafter": sample.drafter, "k": sample.k,
            "exploration": sample.exploration, "mean_k": sample.mean_k, "temperature": prompt.temperature,
            "seconds_since_switch": time.monotonic() - switched_at if late else 0.0,
        })  # fmt: skip
    alarms = fetch_drift(controller, "drift")
    return {**switch_point(timeline), "half_life_seconds": HALF_LIFE_SECONDS, "alarms": alarms, "timeline": timeline}


def switch_point(timeline: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The first phase's drafter (its last decisions, probes aside) and the requests after the switch until the
    controller stopped choosing it for good."""
    before = [t["drafter"] for t in timeline if t["phase"] == "high" and not t["exploration"]][-8:]
    old = max(set(before), key=before.count) if before else "none"
    after = [t for t in timeline if t["phase"] == "low"]
    switch = next((j for j in range(len(after)) if all(t["drafter"] != old for t in after[j:] if not t["exploration"])),
                  None)  # fmt: skip
    seconds = after[switch]["seconds_since_switch"] if switch is not None and switch < len(after) else None
    return {"before": old, "requests_to_switch": switch, "seconds_to_switch": seconds}


HALF_LIFE_SECONDS = 120.0  # the bench controller's learning half-life (the demo's)


def fetch_drift(address: str, segment: str) -> list[dict[str, Any]]:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from specd_api.v1 import controller_pb2 as pb
    from specd_api.v1 import controller_pb2_grpc as pb_grpc

    time.sleep(1.0)  # two refreshes: the last reports are in
    with grpc.insecure_channel(address) as channel:
        stats = pb_grpc.ControllerStub(channel).GetSegmentStats(pb.GetSegmentStatsRequest(segment=segment), timeout=10)
    return [MessageToDict(a, preserving_proto_field_name=True) for a in stats.drift]


def fetch_costs(address: str) -> dict[str, Any]:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from specd_api.v1 import controller_pb2 as pb
    from specd_api.v1 import controller_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        model = pb_grpc.ControllerStub(channel).GetCosts(pb.GetCostsRequest(), timeout=10)
    return MessageToDict(model, preserving_proto_field_name=True)


@contextmanager
def progress_bar(console: Console, total: int) -> Iterator[Callable[[], None]]:
    """A bar with an ETA on a terminal; elsewhere (CI logs, a pipe) a line every 10 seconds. Yields ``advance``."""
    if console.is_terminal:
        columns = (TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"),
                   TimeRemainingColumn())  # fmt: skip
        with Progress(*columns, console=console) as bar:
            task = bar.add_task("bench", total=total)
            yield lambda: bar.advance(task)
        return
    started = time.monotonic()
    state = {"done": 0, "said": started}

    def advance() -> None:
        state["done"] += 1
        now = time.monotonic()
        if now - state["said"] >= 10 or state["done"] == total:
            state["said"] = now
            elapsed = now - started
            eta = elapsed / state["done"] * (total - state["done"])
            console.print(f"bench: {state['done']}/{total} requests, {elapsed:.0f} s elapsed, ETA {eta:.0f} s")

    yield advance


# -- services -------------------------------------------------------------------------------------------------


def start_services(options: BenchOptions, paths: DemoPaths, services: dict[str, Service], console: Console,
                   seed: int = 0) -> None:  # fmt: skip
    """The controller (fresh state under ``paths``), then the controlled worker and the uncontrolled one; ``seed``
    picks the requests --noise stalls (each worker its own)."""
    cap = max([8, *options.batches])  # the learned costs decide where speculation stops paying, up to this batch
    policy = write_config(paths.config("policy"), with_off_rule(bench_policy(options.policy, cap)),
                          f"specd bench: {options.policy}, max_batch_size {cap}, aa/* never speculating")  # fmt: skip
    config = controller_config(paths, policy)
    config["telemetry"] = {"exporter": "none"}
    config["learning"]["half_life_seconds"] = HALF_LIFE_SECONDS
    controller_file = write_config(paths.config("controller"), config, "specd bench: the controller")
    console.print("starting the controller (embedded Redis, fresh state) …")
    services["controller"] = start("controller", ["controller", "--config", str(controller_file)],
                                   paths.log("controller"), timeout_seconds=180)  # fmt: skip
    for name, what in (("worker", "the controlled worker"), ("baseline", "the uncontrolled worker")):
        worker = worker_config(paths, name, options.target, options.draft)
        worker.update(dtype=options.dtype, speculation_max_batch=cap, max_batch=max(16, cap))
        worker["head"] = str(options.head.resolve()) if options.head is not None else None
        worker["telemetry"] = {"exporter": "none"}
        if options.noise is not None:
            worker["fault_injection"] = options.noise.worker_setting(seed + (UNCONTROLLED_SEED if name == "baseline"
                                                                              else 0))  # fmt: skip
        controller = services["controller"].address
        if name == "baseline":
            worker, controller = uncontrolled_worker_config(worker), "none"
        worker_file = write_config(paths.config(name), worker, f"specd bench: {what}")
        console.print(f"starting {what} …")
        args = ["worker", "--config", str(worker_file), "--controller", controller]
        services[name] = start(name, args, paths.log(name), timeout_seconds=300)


UNCONTROLLED_SEED = 1000  # added to the uncontrolled worker's fault-injection seed: its stalls fall on other requests


def bench_policy(policy: Path, cap: int) -> dict[str, Any]:
    import yaml

    loaded = yaml.safe_load(policy.read_text()) or {}
    defaults = {**(loaded.get("defaults") or {}), "max_batch_size": cap}
    return {**loaded, "defaults": defaults}


def stop(services: dict[str, Service], paths: DemoPaths) -> None:
    for name in ("worker", "baseline", "controller"):
        service = services.get(name)
        if service is not None:
            service.stop()
    stop_orphan(paths.run / "controller-state" / "redis" / PID_FILE)


def dump(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def flatten(samples: Iterable[Sample]) -> list[dict[str, Any]]:
    return [{k: v for k, v in asdict(s).items() if k != "text"} for s in samples]
