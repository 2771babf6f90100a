"""The demo's ordered stop (specd/demo/run.py ``stop_all``) with real child processes: a service that drains on
SIGTERM is not killed, one that ignores SIGTERM is killed at the timeout, and a second Ctrl-C (the lifecycle's
``force_exit``) kills at once instead of waiting out the drain."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from specd.demo.run import stop_all
from specd.launch import Service

SERVE = "import signal, sys, time; signal.signal(signal.SIGTERM, {}); print('up', flush=True); time.sleep(60)"
DRAINS = SERVE.format("lambda *_: sys.exit(0)")
STUBBORN = SERVE.format("signal.SIG_IGN")


def child(name: str, code: str) -> Service:
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "up\n"  # its SIGTERM handler is in place
    return Service(name, process)


def test_a_service_that_drains_is_stopped_not_killed():
    service = child("drains", DRAINS)
    assert stop_all([service], threading.Event(), timeout_seconds=10) == []
    assert service.process.returncode == 0


def test_a_service_that_ignores_sigterm_is_killed_at_the_timeout():
    stubborn, drains = child("stubborn", STUBBORN), child("drains", DRAINS)
    started = time.monotonic()
    assert stop_all([stubborn, drains], threading.Event(), timeout_seconds=1.0) == ["stubborn"]
    assert 1.0 <= time.monotonic() - started < 5
    assert drains.process.returncode == 0 and stubborn.process.returncode == -9


def test_a_second_ctrl_c_kills_at_once():
    stubborn = child("stubborn", STUBBORN)
    force = threading.Event()
    threading.Timer(0.3, force.set).start()
    started = time.monotonic()
    assert stop_all([stubborn], force, timeout_seconds=30) == ["stubborn"]
    assert time.monotonic() - started < 3
