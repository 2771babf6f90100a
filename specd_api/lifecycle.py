"""One lifecycle for every specd process that runs until it is told to stop (the controller daemon, the decode
worker, the demo), on the pattern of uvicorn's ``Server``: ``serve`` = signals installed -> startup -> main loop
-> shutdown -> signals restored.

- Signal handlers only set flags (``should_exit``, ``force_exit``, ``reload_requested``); the main loop polls them.
  Nothing is raised into a thread join, a lock or a half-written line.
- ``Lifecycle.signals()`` is the one place handlers are installed, and it restores the previous ones however the
  block ends.
- A second SIGINT while shutting down sets ``force_exit``: stop waiting for the drain.
- ``replay=True`` re-raises the caught exit signals once the previous handlers are back (uvicorn does this), for a
  lifecycle nested in a host that must see them. specd's commands exit with their own status instead.
- ``shutdown`` returns a ``Drain``: what finished and what was cut short; ``serve`` logs it as one line.

Stdlib only: both halves import this leaf.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Protocol

EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def freeze_startup_heap() -> None:
    """Put what start-up made (modules, models, tokenizers, the policy) out of the cyclic collector's reach, so that a
    full collection walks only what came since. A full collection holds the interpreter for as long as it walks: in
    the controller 50-60 ms every few reports at the size bound, in a worker with transformers loaded 0.2 s during a
    large prompt; either way every request on the event loop waits for it. Call it once, when start-up
    is done and before serving."""
    gc.collect()
    gc.freeze()


class Lifecycle:
    """The cooperative flags a process's signals set, and the context manager that installs the handlers."""

    def __init__(
        self,
        exit_signals: tuple[signal.Signals, ...] = EXIT_SIGNALS,
        reload_signals: tuple[signal.Signals, ...] = (),
        replay: bool = False,
    ) -> None:
        self.exit_signals, self.reload_signals, self.replay = exit_signals, reload_signals, replay
        self.should_exit = threading.Event()  # stop serving and shut down
        self.force_exit = threading.Event()  # a second Ctrl-C: stop waiting for the drain
        self.reload_requested = threading.Event()
        self.received: list[int] = []  # the signals caught, in order
        self.exit_requested_at: float | None = None  # time.monotonic() of the first request to exit
        self._interruptible = False

    @property
    def exit_signal(self) -> int | None:
        """The first exit signal caught, if any (a command exits 128 + it)."""
        return next((s for s in self.received if s in self.exit_signals), None)

    def request_exit(self) -> None:
        if self.exit_requested_at is None:
            self.exit_requested_at = time.monotonic()
        self.should_exit.set()

    def take_reload(self) -> bool:
        """True once per reload request (the main loop's poll)."""
        if not self.reload_requested.is_set():
            return False
        self.reload_requested.clear()
        return True

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: flags only (and ``interruptible``'s one documented exception)."""
        self.received.append(signum)
        if signum in self.reload_signals:
            self.reload_requested.set()
            return
        if self.should_exit.is_set() and signum == signal.SIGINT:
            self.force_exit.set()
            return
        self.request_exit()
        if self._interruptible:
            raise KeyboardInterrupt

    @contextmanager
    def signals(self) -> Iterator[Lifecycle]:
        """Install the handlers; restore the previous ones on the way out (and replay, if asked). Off the main
        thread (tests run daemons on others) it installs nothing: Python handles signals on the main thread only."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {sig: signal.signal(sig, self.handle) for sig in (*self.exit_signals, *self.reload_signals)}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if self.replay:
            for signum in reversed([s for s in self.received if s in self.exit_signals]):
                signal.raise_signal(signum)

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """A blocking wait that cannot poll the flags (a child process's start-up) may be cut short as Python's
        default Ctrl-C would: inside this block the first exit signal also raises KeyboardInterrupt. Use it only
        around code that cleans up on BaseException; everywhere else handlers set flags and nothing more."""
        if self.should_exit.is_set():
            raise KeyboardInterrupt
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False


@dataclass(frozen=True)
class Drain:
    """What a shutdown finished and what it cut short, each as counts by what (``{"requests in flight": 2}``)."""

    finished: Mapping[str, int] = field(default_factory=dict)
    cut_short: Mapping[str, int] = field(default_factory=dict)
    forced: bool = False  # a second Ctrl-C ended the wait

    @property
    def complete(self) -> bool:
        return not any(self.cut_short.values())

    def describe(self, seconds: float) -> str:
        done = ", ".join(f"{n} {what}" for what, n in self.finished.items() if n)
        if self.complete:
            return f"drained in {seconds:.1f}s ({done or 'nothing in flight'}); nothing cut short"
        cut = ", ".join(f"{n} {what}" for what, n in self.cut_short.items() if n)
        forced = " by a second Ctrl-C" if self.forced else ""
        return f"drained in {seconds:.1f}s{f' ({done})' if done else ''}; cut short{forced}: {cut}"


class Server(Protocol):
    """What ``serve`` runs. ``shutdown`` must cope with a ``startup`` that failed half way."""

    lifecycle: Lifecycle

    def startup(self) -> None: ...

    def main_loop(self) -> None: ...

    def shutdown(self) -> Drain: ...


def serve(server: Server, log: logging.Logger) -> Drain:
    """Signals installed -> startup -> main loop (skipped if a signal came during start-up) -> shutdown, which
    always runs -> previous handlers restored. The drain (from the request to exit, or the end of start-up if that
    came later) is logged as one line, a warning when it cut something short; after a start-up that failed, only
    if it cut something short. A start-up error propagates."""
    lifecycle = server.lifecycle
    started_at: float | None = None
    with lifecycle.signals():
        try:
            server.startup()
            started_at = time.monotonic()
            if not lifecycle.should_exit.is_set():
                server.main_loop()
        finally:
            stopping_at = time.monotonic()
            drain = server.shutdown()
            if started_at is not None or not drain.complete:
                since = max(lifecycle.exit_requested_at or stopping_at, started_at or stopping_at)
                level = logging.INFO if drain.complete else logging.WARNING
                log.log(level, drain.describe(time.monotonic() - since))
    return drain
