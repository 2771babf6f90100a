"""The test suite's waiting helpers, written once: a free loopback port, and polling a condition until it holds."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(condition: Callable[[], object], timeout: float = 10.0, every: float = 0.02, what: str = "") -> bool:
    """Poll ``condition`` until it is true (True) or ``timeout`` seconds pass (False, after one last look). With
    ``what``, a timeout fails the test instead, saying what did not happen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(every)
    if condition():
        return True
    assert not what, f"{what}: not within {timeout} s"
    return False
