"""Start specd's services as child processes and know when they are ready: the demo uses this, and so do
the end-to-end tests (real processes, real sockets).

Each service prints a "listening on ADDRESS" line once it serves; ``start`` waits for it (or for the
process to die, reporting its last output), and ``stop`` sends SIGTERM, then SIGKILL after a timeout.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from specd_api.errors import SpecdError

_LISTENING = re.compile(r"listening on (?:http://)?(\S+?:\d+)")


class LaunchError(SpecdError):
    """A service did not come up."""


@dataclass
class Service:
    name: str
    process: subprocess.Popen[str]
    address: str = ""
    log_path: Path | None = None
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_seconds: float = 15.0) -> int | None:
        """SIGTERM (graceful drain), then SIGKILL; returns the exit status."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        return self.process.returncode

    def kill(self) -> None:
        """SIGKILL: a crash, as far as everyone else can tell."""
        if self.alive():
            self.process.kill()
            self.process.wait(timeout=5)


def start(
    name: str,
    args: list[str],
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
    timeout_seconds: float = 120.0,
    cwd: Path | None = None,
) -> Service:
    """Run ``specd ARGS`` and wait for its "listening on" line. Output goes on to ``log_path`` if given."""
    command = [sys.executable, "-m", "specd", *args]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        cwd=cwd,
        start_new_session=True,  # Ctrl-C in the terminal reaches the parent only; it stops children in order
    )
    service = Service(name, process, log_path=log_path)
    ready = threading.Event()
    threading.Thread(target=_pump, args=(service, ready), name=f"{name}-output", daemon=True).start()
    deadline = time.monotonic() + timeout_seconds
    try:
        while not ready.wait(0.05):
            if not service.alive():
                ready.wait(0.5)  # let the pump read the last lines
                raise LaunchError(f"{name} exited with status {process.returncode}:\n" + "".join(service.tail))
            if time.monotonic() > deadline:
                raise LaunchError(f"{name} did not start within {timeout_seconds:g} s:\n" + "".join(service.tail))
    except BaseException:  # not started, timed out, or Ctrl-C while waiting: the caller has no Service to stop
        service.kill()
        raise
    return service


def _pump(service: Service, ready: threading.Event) -> None:
    assert service.process.stdout is not None
    log = service.log_path.open("a") if service.log_path else None
    try:
        for line in service.process.stdout:
            service.tail.append(line)
            if log is not None:
                log.write(line)
                log.flush()
            match = _LISTENING.search(line)
            if match and not ready.is_set():
                service.address = match.group(1)
                ready.set()
    finally:
        if log is not None:
            log.close()
