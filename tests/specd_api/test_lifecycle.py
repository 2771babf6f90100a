"""specd_api.lifecycle on its own, with real signals sent to this process (pytest runs tests on the main thread,
where Python runs signal handlers): handlers set flags and raise nothing, the previous handlers come back, a
second Ctrl-C forces, replay hands the signal on, and ``serve`` always shuts down."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from types import FrameType

import pytest

from specd_api.lifecycle import Drain, Lifecycle, serve


class Recorder:
    """A stand-in previous handler: remembers what reached it."""

    def __init__(self) -> None:
        self.received: list[int] = []

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.received.append(signum)


def send(*signals: int) -> None:
    """Deliver each signal to this process; a handler that raises fails the test instead of ending pytest."""
    try:
        for sig in signals:
            signal.raise_signal(sig)
    except KeyboardInterrupt:
        pytest.fail(f"a handler raised KeyboardInterrupt ({signals})")


@pytest.fixture
def previous() -> Iterator[Recorder]:
    """Installs a recorder as SIGINT/SIGTERM/SIGHUP's handler for the test, pytest's own ones afterwards."""
    recorder = Recorder()
    saved = {sig: signal.signal(sig, recorder) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield recorder
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_a_signal_only_sets_the_flag_and_the_previous_handler_comes_back(previous: Recorder):
    lifecycle = Lifecycle()
    with lifecycle.signals():
        assert signal.getsignal(signal.SIGTERM) == lifecycle.handle
        send(signal.SIGTERM)  # raises nothing
        assert lifecycle.should_exit.is_set() and not lifecycle.force_exit.is_set()
    assert lifecycle.exit_signal == signal.SIGTERM
    for sig in (signal.SIGINT, signal.SIGTERM):
        assert signal.getsignal(sig) is previous
    assert previous.received == []  # no replay unless asked


def test_the_handlers_come_back_when_the_block_raises(previous: Recorder):
    with pytest.raises(RuntimeError), Lifecycle().signals():
        raise RuntimeError("startup failed")
    assert signal.getsignal(signal.SIGTERM) is previous


@pytest.mark.parametrize(
    ("signals", "forced"),
    [
        ((signal.SIGINT,), False),  # one Ctrl-C: a graceful stop
        ((signal.SIGINT, signal.SIGINT), True),  # a second Ctrl-C: stop waiting for the drain
        ((signal.SIGTERM, signal.SIGINT), True),  # Ctrl-C while a SIGTERM drains
        ((signal.SIGTERM, signal.SIGTERM), False),  # supervisors repeat SIGTERM; that is no reason to cut the drain
    ],
)
def test_only_a_second_sigint_forces_exit(previous: Recorder, signals: tuple[int, ...], forced: bool):
    lifecycle = Lifecycle()
    with lifecycle.signals():
        send(*signals)
    assert lifecycle.should_exit.is_set()
    assert lifecycle.force_exit.is_set() is forced
    assert lifecycle.exit_signal == signals[0]


def test_a_reload_signal_requests_a_reload_once_and_no_exit(previous: Recorder):
    lifecycle = Lifecycle(reload_signals=(signal.SIGHUP,))
    with lifecycle.signals():
        send(signal.SIGHUP)
    assert not lifecycle.should_exit.is_set() and lifecycle.exit_signal is None
    assert lifecycle.take_reload() and not lifecycle.take_reload()
    assert signal.getsignal(signal.SIGHUP) is previous


def test_replay_hands_the_exit_signals_to_the_previous_handler_once_restored(previous: Recorder):
    lifecycle = Lifecycle(reload_signals=(signal.SIGHUP,), replay=True)
    with lifecycle.signals():
        send(signal.SIGTERM, signal.SIGHUP, signal.SIGINT)  # a reload (SIGHUP) is not replayed
        assert previous.received == []
    assert previous.received == [signal.SIGINT, signal.SIGTERM]  # last in, first out, as uvicorn does


def test_interruptible_raises_on_the_first_exit_signal_and_only_inside(previous: Recorder):
    lifecycle = Lifecycle()
    with lifecycle.signals():
        with lifecycle.interruptible():
            pass  # nothing arrived
        send(signal.SIGTERM)  # outside: a flag, not an exception
        assert lifecycle.should_exit.is_set()
        with pytest.raises(KeyboardInterrupt), lifecycle.interruptible():  # a stop was asked for already
            pass
    lifecycle = Lifecycle()
    with lifecycle.signals(), pytest.raises(KeyboardInterrupt), lifecycle.interruptible():
        signal.raise_signal(signal.SIGTERM)
    assert lifecycle.exit_signal == signal.SIGTERM


def test_off_the_main_thread_nothing_is_installed(previous: Recorder):
    seen: list[object] = []

    def run() -> None:
        with Lifecycle().signals():
            seen.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert seen == [previous]


class FakeServer:
    def __init__(self, fail_startup: bool = False, signal_in_startup: int | None = None, drain: Drain | None = None):
        self.lifecycle = Lifecycle()
        self.calls: list[str] = []
        self.fail_startup, self.signal_in_startup, self.drain = fail_startup, signal_in_startup, drain or Drain()

    def startup(self) -> None:
        self.calls.append("startup")
        if self.signal_in_startup is not None:
            send(self.signal_in_startup)
        if self.fail_startup:
            raise ValueError("port in use")

    def main_loop(self) -> None:
        self.calls.append("main_loop")
        send(signal.SIGTERM)
        assert self.lifecycle.should_exit.wait(1.0)

    def shutdown(self) -> Drain:
        self.calls.append("shutdown")
        self.calls.append(f"handler installed: {signal.getsignal(signal.SIGINT) == self.lifecycle.handle}")
        return self.drain


def test_serve_runs_startup_main_loop_shutdown_with_the_signals_installed(previous: Recorder, caplog):
    server = FakeServer(drain=Drain(finished={"requests finished": 2}))
    with caplog.at_level(logging.INFO):
        assert serve(server, logging.getLogger("test")) == server.drain
    assert server.calls == ["startup", "main_loop", "shutdown", "handler installed: True"]  # a 2nd Ctrl-C counts
    assert signal.getsignal(signal.SIGTERM) is previous
    [record] = caplog.records
    assert record.levelno == logging.INFO
    assert (
        record.getMessage().startswith("drained in ") and "(2 requests finished); nothing cut short" in record.message
    )


def test_a_signal_during_startup_skips_the_main_loop(previous: Recorder):
    server = FakeServer(signal_in_startup=signal.SIGTERM)
    serve(server, logging.getLogger("test"))
    assert server.calls[:2] == ["startup", "shutdown"]


def test_a_failed_startup_still_shuts_down_and_propagates(previous: Recorder, caplog):
    server = FakeServer(fail_startup=True)
    with pytest.raises(ValueError, match="port in use"):
        serve(server, logging.getLogger("test"))
    assert server.calls[:2] == ["startup", "shutdown"]
    assert caplog.records == []  # nothing was running: no drain line to read


def test_a_drain_that_cut_something_short_is_a_warning_naming_it(previous: Recorder, caplog):
    drain = Drain(finished={"requests finished": 1}, cut_short={"requests cancelled": 2, "reports dropped": 0})
    serve(FakeServer(drain=drain), logging.getLogger("test"))
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert record.getMessage().endswith("(1 requests finished); cut short: 2 requests cancelled")


def test_a_forced_drain_says_so():
    drain = Drain(cut_short={"requests cancelled": 1}, forced=True)
    assert drain.describe(0.25) == "drained in 0.2s; cut short by a second Ctrl-C: 1 requests cancelled"
