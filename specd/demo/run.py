"""`specd demo`, in plain sight: prepare the run folder -> start the controller and two workers -> drive the
workloads at both while the table updates -> shut down in order (workers drain and flush first, then the
controller) -> report.

Ctrl-C (or SIGTERM) stops sending, shuts down in the same order, prints what was measured so far and exits
130 (143); a second Ctrl-C during the shutdown kills what is left. A service that does not start ends the run
with one line naming its log (exit 2). No child process outlives the demo.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

import workloads as workloads_package
from controller.policy import load_policy
from controller.redis_conn import PID_FILE, stop_orphan
from controller.yaml_config import ConfigError
from specd.demo import driver as drv
from specd.demo.configs import DemoPaths, controller_config, demo_policy, worker_config, write_config
from specd.demo.driver import BASELINE_PREFIX
from specd.demo.plot import plot
from specd.demo.report import DemoReport, Learned, fetch_learned, read_traces
from specd.demo.view import progress_line, progress_table, render_summary, shown
from specd.launch import LaunchError, Service, start
from specd_api.errors import SpecdError
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
    services: dict[str, Service] = {}
    driver = drv.Driver({}, requests, options.concurrency)
    started = time.monotonic()  # the table's clock starts with the traffic; the summary's with the run
    run_started = started
    learned: list[Learned] | None = None
    learned_error = "the controller did not start"
    with signals_as_interrupt() as received:
        try:
            start_services(options, paths, services, console)
            driver.urls = {drv.ADAPTIVE: services[ADAPTIVE].url, drv.BASELINE: services[BASELINE].url}
            started = time.monotonic()
            driver.start()
            # From here a first signal only sets a flag that the watch loop polls: raising KeyboardInterrupt
            # into a thread join or a console write can leave a lock or the output half-done.
            received["cooperative"] = 1
            watch(driver, drv.totals_of(requests), options, services, console, started, lambda: "signal" in received)
        except KeyboardInterrupt:
            received.setdefault("signal", signal.SIGINT)
        finally:
            learned, learned_error = shut_down(services, driver, paths, console)
    results = driver.results()
    rows, overall = drv.summarize(drv.totals_of(requests), results)
    interrupted = "signal" in received
    picture = plot(rows, paths.plot, title=f"specd demo ({options.settings})") if results else None
    report = DemoReport(
        rows=rows,
        overall=overall,
        requests_planned=len(requests) * len(drv.ARMS),
        seconds=time.monotonic() - run_started,
        interrupted=interrupted,
        settings=options.settings,
        fallbacks=drv.fallback_counts(results),
        learned=learned,
        learned_error=learned_error,
        traces=read_traces(paths.traces(name) for name in (ADAPTIVE, BASELINE, CONTROLLER)),
        plot=picture,
        logs=[paths.log(name) for name in (CONTROLLER, ADAPTIVE, BASELINE) if name in services],
    )
    console.print(render_summary(report, console.width))
    if interrupted:
        return 128 + int(received["signal"])
    return 1 if overall.failures else 0


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


def prepare_run_folder(paths: DemoPaths) -> None:
    """Wipe the previous run (learning starts fresh) and mark the folder as the demo's."""
    run = paths.run
    if run.exists():
        if any(run.iterdir()) and not (run / MARKER).exists():
            raise DemoError(f"{run} is not empty and is not a demo run folder; refusing to wipe it (use --out)")
        # A previous run killed with SIGKILL may have left its controller's embedded Redis behind.
        stop_orphan(run / "controller-state" / "redis" / PID_FILE)
        shutil.rmtree(run)
    paths.logs.mkdir(parents=True)
    (run / MARKER).write_text("specd demo run folder: wiped at the start of every run\n")


# -- services -------------------------------------------------------------------------------------------------


def start_services(options: DemoOptions, paths: DemoPaths, services: dict[str, Service], console: Console) -> None:
    """Controller, then the adaptive worker (asks it), then the baseline worker (asks it too; the demo's
    policy forces no speculation for its baseline/* segments, so the two differ only in the decision).
    Each one is in ``services`` as soon as it runs, so that the caller can stop it whatever happens next."""
    policy = options.policy  # if it is invalid, the controller refuses it naming its file, line and field
    with contextlib.suppress(ConfigError):
        load_policy(options.policy)
        policy = write_config(paths.config("policy"), demo_policy(options.policy, BASELINE_PREFIX),
                              f"specd demo: {options.policy} plus the baseline rule")  # fmt: skip
    controller_file = write_config(paths.config(CONTROLLER), controller_config(paths, policy),
                                   "specd demo: the controller")  # fmt: skip
    console.print(f"starting the controller (embedded Redis, policy {shown(options.policy)}) …", soft_wrap=True)
    controller = launch(CONTROLLER, ["controller", "--config", str(controller_file)], paths, options)
    services[CONTROLLER] = controller
    for name, link, what in (
        (ADAPTIVE, controller.address, f"asks the controller at {controller.address}"),
        (BASELINE, controller.address, f"asks the controller, whose policy says no speculation for {BASELINE_PREFIX}*"),
    ):
        config = worker_config(paths, name, options.target, options.draft)
        path = write_config(paths.config(name), config, f"specd demo: {TITLES[name]}")
        console.print(f"starting {TITLES[name]} ({what}) …", soft_wrap=True)
        args = ["worker", "--config", str(path), "--listen", "127.0.0.1:0", "--controller", link, "--log-level", "INFO"]
        services[name] = launch(name, args, paths, options)
    console.print(
        f"controller {controller.address}, adaptive worker {services[ADAPTIVE].url}, baseline worker "
        f"{services[BASELINE].url}; run folder {shown(paths.run)}",
        soft_wrap=True,
    )


def launch(name: str, args: list[str], paths: DemoPaths, options: DemoOptions) -> Service:
    try:
        return start(name, args, paths.log(name), timeout_seconds=options.start_timeout_seconds)
    except LaunchError as e:
        first, *output = [line.strip() for line in str(e).splitlines() if line.strip()]
        reason = first.removeprefix(f"{name} ").rstrip(":")
        last = f": {output[-1]}" if output else ""
        raise DemoError(f"{TITLES[name]} did not start ({reason}){last}; see {paths.log(name)}") from None


def shut_down(
    services: dict[str, Service], driver: drv.Driver, paths: DemoPaths, console: Console
) -> tuple[list[Learned] | None, str]:
    """Stop sending; SIGTERM the workers (they finish open requests, flush telemetry to the controller and spans
    to their files); ask the controller what it learned; stop it. A second Ctrl-C kills whatever is left."""
    learned: list[Learned] | None = None
    learned_error = "the controller did not start"
    try:
        driver.stop()
        if services:
            say(console, "stopping the workers, then the controller …")
        for name in (ADAPTIVE, BASELINE):
            if name in services:
                services[name].stop()
        driver.join(timeout_seconds=10.0)
        controller = services.get(CONTROLLER)
        if controller is not None and controller.alive():
            time.sleep(1.0)  # two refreshes, so the workers' last reports are in what it answers
            try:
                learned = fetch_learned(controller.address)
            except Exception as e:  # the summary says why, and the demo still ends cleanly
                learned_error = f"ListSegments failed: {e}"
            controller.stop()
    except KeyboardInterrupt:
        say(console, "second interrupt: killing the services")
        learned_error = "interrupted"
    finally:
        for service in services.values():
            service.kill()  # no-op for the ones already stopped
        stop_orphan(paths.run / "controller-state" / "redis" / PID_FILE)  # a killed controller's Redis
    return learned, learned_error


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


@contextmanager
def signals_as_interrupt() -> Iterator[dict[str, int]]:
    """SIGINT, SIGTERM and SIGHUP (the terminal closed) all mean an orderly shutdown. The dict says which signal
    arrived first. SIGINT is installed too because a process started in the background by a non-interactive
    shell inherits it as ignored, and Ctrl-C (or a supervisor's SIGINT) must still stop the demo."""
    received: dict[str, int] = {}
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        first = "signal" not in received
        received.setdefault("signal", signum)
        if first and received.get("cooperative"):
            return  # the watch loop polls for it
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def say(console: Console, text: str) -> None:
    """Print during the shutdown: a terminal that went away must not stop the shutdown."""
    with suppress(OSError):
        console.print(text, soft_wrap=True)
