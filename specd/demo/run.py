"""`specd demo`, in plain sight: prepare the run folder -> start the controller and two workers -> drive the
workloads at both while the table updates -> shut down in order (workers drain and flush first, then the
controller) -> report.

The run is a specd_api.lifecycle server: startup = the services and the traffic, main loop = the watch, shutdown =
the ordered stop. Ctrl-C (or SIGTERM, or SIGHUP: the terminal closed) stops sending, shuts down in the same order,
prints what was measured so far and exits 130 (143, 129); a second Ctrl-C during the shutdown kills what is left.
A service that does not start ends the run with one line naming its log (exit 2). No child process outlives the
demo.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

import workloads as workloads_package
from controller.decision.policy import load_policy
from controller.storage.redis_conn import PID_FILE, stop_orphan
from specd.demo import driver as drv
from specd.demo.configs import (
    AA_PREFIX,
    DemoPaths,
    controller_config,
    demo_policy,
    uncontrolled_worker_config,
    worker_config,
    write_config,
)
from specd.demo.plot import plot
from specd.demo.report import DemoReport, Learned, fetch_learned, read_traces, write_summary
from specd.demo.view import progress_line, progress_table, render_summary, shown
from specd.launch import LaunchError, Service, start
from specd_api.errors import SpecdError
from specd_api.lifecycle import Drain, Lifecycle, serve
from specd_api.yaml_config import ConfigError
from workloads import Prompt, load_all

MARKER = ".specd-demo"  # a run folder holds this, so that wiping never touches a folder the demo did not make
CONTROLLER, ADAPTIVE, BASELINE = "controller", "worker-adaptive", "worker-baseline"
TITLES = {CONTROLLER: "the controller", ADAPTIVE: "the adaptive worker", BASELINE: "the baseline worker"}
PLAIN_EVERY_SECONDS = 5.0


class DemoError(SpecdError):
    """The demo cannot run (a service did not start, a run folder it will not wipe)."""


@dataclass(frozen=True)
class DemoOptions:
    out: Path
    prompts_per_segment: int
    max_tokens: int
    concurrency: int
    seed: int
    workloads: Path
    segments: tuple[str, ...] | None  # None: every workload
    target: Path
    draft: Path | None
    policy: Path
    live: bool  # the live table; False: a progress line every few seconds
    start_timeout_seconds: float = 180.0

    @property
    def settings(self) -> str:
        return (
            f"{self.prompts_per_segment} prompts per segment, max {self.max_tokens} tokens, "
            f"concurrency {self.concurrency}, seed {self.seed}"
        )


def run_demo(options: DemoOptions, console: Console) -> int:
    """The whole demo; returns the exit status."""
    requests = drv.plan(select(load_all(options.workloads), options.segments), options.prompts_per_segment,
                        options.max_tokens, options.seed)  # fmt: skip
    paths = DemoPaths(options.out.resolve())  # the configs name absolute paths: they resolve against their folder
    prepare_run_folder(paths)
    run = DemoRun(options, paths, requests, console)
    with said_on(console, run.log), suppress(KeyboardInterrupt):  # only from a start-up wait (see launch)
        serve(run, run.log)
    results = run.driver.results()
    rows, overall = drv.summarize(drv.totals_of(requests), results, intervals=True)
    picture = plot(rows, paths.plot, title=f"specd demo ({options.settings})") if results else None
    report = DemoReport(
        rows=rows,
        overall=overall,
        requests_planned=len(requests) * len(drv.ARMS),
        seconds=time.monotonic() - run.run_started,
        interrupted=run.lifecycle.should_exit.is_set(),
        settings=options.settings,
        fallbacks=drv.fallback_counts(results),
        learned=run.learned,
        learned_error=run.learned_error,
        traces=read_traces(paths.traces(name) for name in (ADAPTIVE, BASELINE, CONTROLLER)),
        plot=picture,
        logs=[paths.log(name) for name in (CONTROLLER, ADAPTIVE, BASELINE) if name in run.services],
        aa=drv.aa_figure(results),
    )
    write_summary(report, paths.summary)
    console.print(render_summary(report, console.width))
    if run.lifecycle.should_exit.is_set():
        return 128 + (run.lifecycle.exit_signal or signal.SIGINT)
    return 1 if overall.failures else 0


class DemoRun:
    """One run as a specd_api.lifecycle server: startup starts the services and the traffic, the main loop watches
    it, shutdown stops everything in order. What it measured and learned stays here for the summary."""

    def __init__(self, options: DemoOptions, paths: DemoPaths, requests: list[drv.Request], console: Console) -> None:
        self.options, self.paths, self.requests, self.console = options, paths, requests, console
        # SIGINT is installed explicitly: a process started in the background by a non-interactive shell inherits
        # it as ignored, and Ctrl-C (or a supervisor's SIGINT) must still stop the demo.
        self.lifecycle = Lifecycle(exit_signals=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
        self.log = logging.getLogger("specd.demo")
        self.services: dict[str, Service] = {}
        self.driver = drv.Driver({}, requests, options.concurrency)
        self.run_started = time.monotonic()  # the summary's clock starts with the run; the table's with the traffic
        self.learned: list[Learned] | None = None
        self.learned_error = "the controller did not start"

    def startup(self) -> None:
        start_services(self.options, self.paths, self.services, self.console, self.lifecycle)
        adaptive, baseline = self.services[ADAPTIVE].url, self.services[BASELINE].url
        self.driver.urls = {drv.ADAPTIVE: adaptive, drv.BASELINE: baseline, drv.AA: adaptive}
        self.driver.start()

    def main_loop(self) -> None:
        watch(self.driver, drv.totals_of(self.requests), self.options, self.services, self.console, time.monotonic(),
              self.lifecycle.should_exit.is_set)  # fmt: skip

    def shutdown(self) -> Drain:
        self.learned, self.learned_error, drain = shut_down(self.services, self.driver, self.paths, self.console,
                                                            self.lifecycle.force_exit)  # fmt: skip
        return drain


def select(segments: dict[str, list[Prompt]], names: tuple[str, ...] | None) -> dict[str, list[Prompt]]:
    if names is None:
        return segments
    unknown = sorted(set(names) - set(segments))
    if unknown:
        raise DemoError(f"unknown segment(s) {', '.join(unknown)} (the workloads have {', '.join(sorted(segments))})")
    return {name: segments[name] for name in names}


def default_workloads() -> Path:
    return Path(workloads_package.__file__).resolve().parent


# -- the run folder -------------------------------------------------------------------------------------------


def prepare_run_folder(
    paths: DemoPaths, kind: str = "demo", error: type[SpecdError] = DemoError, marker: str | None = None
) -> None:
    """Wipe the previous run (learning starts fresh) and mark the folder as ``kind``'s (the demo's, the bench's:
    each wipes only a folder holding its own ``marker`` file)."""
    marker = marker or MARKER
    run = paths.run
    if run.exists():
        if any(run.iterdir()) and not (run / marker).exists():
            raise error(f"{run} is not empty and is not a {kind} run folder; refusing to wipe it (use --out)")
        # A previous run killed with SIGKILL may have left its controller's embedded Redis behind.
        stop_orphan(run / "controller-state" / "redis" / PID_FILE)
        shutil.rmtree(run)
    paths.logs.mkdir(parents=True)
    (run / marker).write_text(f"specd {kind} run folder: wiped at the start of every run\n")


# -- services -------------------------------------------------------------------------------------------------


def start_services(options: DemoOptions, paths: DemoPaths, services: dict[str, Service], console: Console,
                   lifecycle: Lifecycle) -> None:  # fmt: skip
    """Controller, then the adaptive worker (asks it), then the baseline worker: the same models and settings with
    no controller at all, what a user compares with. The demo's policy forces no speculation for the aa/* segments,
    which the adaptive worker's A/A requests name. Each one is in ``services`` as soon as it runs, so that the
    caller can stop it whatever happens next. A signal while one starts ends its wait at once (KeyboardInterrupt,
    see ``launch``)."""
    policy = options.policy  # if it is invalid, the controller refuses it naming its file, line and field
    with contextlib.suppress(ConfigError):
        load_policy(options.policy)
        policy = write_config(paths.config("policy"), demo_policy(options.policy, AA_PREFIX),
                              f"specd demo: {options.policy} plus the A/A rule")  # fmt: skip
    controller_file = write_config(paths.config(CONTROLLER), controller_config(paths, policy),
                                   "specd demo: the controller")  # fmt: skip
    console.print(f"starting the controller (embedded Redis, policy {shown(options.policy)}) …", soft_wrap=True)
    controller = launch(CONTROLLER, ["controller", "--config", str(controller_file)], paths, options, lifecycle)
    services[CONTROLLER] = controller
    for name, link, what in (
        (ADAPTIVE, controller.address, f"asks the controller at {controller.address}"),
        (BASELINE, "none", "no controller: the same worker without specd"),
    ):
        config = worker_config(paths, name, options.target, options.draft)
        if name == BASELINE:
            config = uncontrolled_worker_config(config)
        path = write_config(paths.config(name), config, f"specd demo: {TITLES[name]}")
        console.print(f"starting {TITLES[name]} ({what}) …", soft_wrap=True)
        args = ["worker", "--config", str(path), "--listen", "127.0.0.1:0", "--controller", link, "--log-level", "INFO"]
        services[name] = launch(name, args, paths, options, lifecycle)
    console.print(
        f"controller {controller.address}, adaptive worker {services[ADAPTIVE].url}, baseline worker "
        f"{services[BASELINE].url}; run folder {shown(paths.run)}",
        soft_wrap=True,
    )


def launch(name: str, args: list[str], paths: DemoPaths, options: DemoOptions, lifecycle: Lifecycle) -> Service:
    """``start`` waits for the "listening" line and cannot poll the lifecycle's flags, so a signal interrupts the
    wait (its ``except BaseException`` kills the half-started process); nowhere else does a signal raise."""
    try:
        with lifecycle.interruptible():
            return start(name, args, paths.log(name), timeout_seconds=options.start_timeout_seconds)
    except LaunchError as e:
        first, *output = [line.strip() for line in str(e).splitlines() if line.strip()]
        reason = first.removeprefix(f"{name} ").rstrip(":")
        last = f": {output[-1]}" if output else ""
        raise DemoError(f"{TITLES[name]} did not start ({reason}){last}; see {paths.log(name)}") from None


def shut_down(
    services: dict[str, Service], driver: drv.Driver, paths: DemoPaths, console: Console, force: threading.Event
) -> tuple[list[Learned] | None, str, Drain]:
    """Stop sending; SIGTERM the workers (they finish open requests, flush telemetry to the controller and spans
    to their files); ask the controller what it learned; stop it. A second Ctrl-C (``force``) kills whatever is
    left. Returns what the controller learned (or why not) and the drain."""
    learned: list[Learned] | None = None
    learned_error = "the controller did not start"
    killed: list[str] = []
    try:
        driver.stop()
        if services:
            say(console, "stopping the workers, then the controller …")
        killed += stop_all([services[name] for name in (ADAPTIVE, BASELINE) if name in services], force)
        deadline = time.monotonic() + 10.0
        while driver.running and time.monotonic() < deadline and not force.is_set():
            driver.join(0.1)
        controller = services.get(CONTROLLER)
        if controller is not None:
            learned, learned_error = ask_what_was_learned(controller, force, drv.traffic_lengths(driver.results()))
            killed += stop_all([controller], force)
        if force.is_set():
            say(console, "second interrupt: killing the services")
            learned_error = "interrupted"
    finally:
        for service in services.values():
            service.kill()  # no-op for the ones already stopped
        stop_orphan(paths.run / "controller-state" / "redis" / PID_FILE)  # a killed controller's Redis
    stopped = len(services) - len(killed)
    return (
        learned,
        learned_error,
        Drain({"services stopped": stopped}, {"services killed": len(killed)}, force.is_set()),
    )


def ask_what_was_learned(
    controller: Service, force: threading.Event, lengths: dict[str, tuple[int, int]] | None = None
) -> tuple[list[Learned] | None, str]:
    """ListSegments, once two refreshes have taken the workers' last reports in, each segment's decision made for
    its traffic's ``lengths`` (new tokens, prompt tokens); or why not."""
    if not controller.alive():
        return None, "the controller did not start"
    if force.wait(1.0):
        return None, "interrupted"
    try:
        return fetch_learned(controller.address, lengths), ""
    except Exception as e:  # the summary says why, and the demo still ends cleanly
        return None, f"ListSegments failed: {e}"


def stop_all(group: list[Service], force: threading.Event, timeout_seconds: float = 15.0) -> list[str]:
    """SIGTERM each service of ``group`` (they drain side by side) and wait; one still running at the timeout, or
    when ``force`` is set, is killed. Returns the names of the killed ones."""
    for service in group:
        if service.alive():
            service.process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_seconds
    while any(s.alive() for s in group) and time.monotonic() < deadline and not force.wait(0.05):
        pass
    killed = [service.name for service in group if service.alive()]
    for service in group:
        service.kill()
    return killed


# -- watching -------------------------------------------------------------------------------------------------


def watch(driver: drv.Driver, totals: dict[str, int], options: DemoOptions, services: dict[str, Service],
          console: Console, started: float, stop_requested: Callable[[], bool] = lambda: False) -> None:  # fmt: skip
    """Until the driver is done: a live table on a terminal, a progress line every few seconds elsewhere. A
    worker that dies ends the traffic (the summary then shows the failed requests)."""

    def snapshot() -> tuple[list[drv.SegmentRow], drv.SegmentRow]:
        return drv.summarize(totals, driver.results())

    def check_services() -> None:
        dead = [name for name, s in services.items() if not s.alive()]
        if dead:
            driver.stop()
            say(console, f"{', '.join(dead)} exited (status {services[dead[0]].process.returncode}); stopping")

    if options.live:
        footer = Text("Ctrl-C stops: shuts everything down and prints what was measured so far", style="dim")
        with Live(console=console, refresh_per_second=4, transient=True) as live:
            while driver.running and not stop_requested():
                rows, overall = snapshot()
                table = progress_table(rows, overall, f"specd demo ({options.settings})", console.width)
                live.update(Group(table, footer))
                driver.join(0.25)
                check_services()
        return
    last = time.monotonic()
    console.print(f"sending {sum(totals.values())} requests ({options.settings})", soft_wrap=True)
    while driver.running and not stop_requested():
        driver.join(0.25)
        check_services()
        if time.monotonic() - last >= PLAIN_EVERY_SECONDS:
            last = time.monotonic()
            console.print(progress_line(*snapshot(), last - started), highlight=False, soft_wrap=True)


class ConsoleLog(logging.Handler):
    """Prints log records on the demo's console, in its words."""

    def __init__(self, console: Console, level: int) -> None:
        super().__init__(level)
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        say(self.console, f"specd demo: {record.getMessage()}")


@contextmanager
def said_on(console: Console, log: logging.Logger) -> Iterator[None]:
    """While the demo runs, what ``log`` warns about (a drain that had to kill a service) is printed on the
    console; the rest (a drain that cut nothing short) is not, so a normal run prints what it always did."""
    handler, propagate = ConsoleLog(console, logging.WARNING), log.propagate
    log.addHandler(handler)
    log.propagate = False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


def say(console: Console, text: str) -> None:
    """Print during the shutdown: a terminal that went away must not stop the shutdown."""
    with suppress(OSError):
        console.print(text, soft_wrap=True)
