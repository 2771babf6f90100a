"""A running controller daemon for tests, written once: a ``ControllerDaemon`` in the test's process on a free loopback
port, with a policy file, a state folder and a Redis key prefix of its own.

``daemon_config`` holds the settings most tests share (and each test overrides what it exercises); ``running`` starts
and stops a daemon from a config (a test that restarts one on the same prefix keeps its keys); ``running_daemon``
does both and deletes the prefix's keys afterwards. ``tests/controller/conftest.py`` has the module-scoped ``daemon``
fixture built on them. (The end-to-end tests start ``specd controller`` processes instead: ``tests/e2e/conftest.py``.)
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc

from controller.config import ControllerConfig, LearningConfig
from controller.server import ControllerDaemon
from controller.storage.redis_conn import make_client

DEFAULT_POLICY = Path(__file__).resolve().parents[1] / "policies" / "default.yaml"
FORCED_OFF_RULE = '\n  - match: "forced-off*"\n    force: none\n'  # a rule that switches `forced-off*` segments off
RPC_TIMEOUT = 5.0


def daemon_config(
    redis_url: str | None, folder: Path, policy: str | Path | None = None, **settings: Any
) -> ControllerConfig:
    """A daemon on 127.0.0.1:0, its state in ``folder / "state"``, 4 RPC threads, a 1 s grace, and a fresh key prefix
    refreshed every 0.1 s with a half-life of 1e7 s (far beyond a test, so decay cannot scale counts).

    ``policy``: text written to ``folder / "policy.yaml"``, a path used as it is, or None for a copy of the shipped
    default policy. ``settings`` override any field; ``learning`` (a dict) overrides the learning section's."""
    if not isinstance(policy, Path):
        folder.mkdir(parents=True, exist_ok=True)
        text = DEFAULT_POLICY.read_text() if policy is None else policy
        policy = folder / "policy.yaml"
        policy.write_text(text)
    learning = {"prefix": f"t{uuid.uuid4().hex[:12]}", "refresh_seconds": 0.1, "half_life_seconds": 1e7}
    learning.update(settings.pop("learning", {}))
    fields: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "redis_url": redis_url,
        "policy_path": policy,
        "state_dir": folder / "state",
        "max_workers": 4,
        "shutdown_grace_seconds": 1.0,
        "learning": LearningConfig(**learning),
    }
    fields.update(settings)
    return ControllerConfig(**fields)


@contextmanager
def running(config: ControllerConfig, clock: Callable[[], float] = time.time) -> Iterator[ControllerDaemon]:
    """The daemon ``config`` describes, started; stopped on the way out (``shutdown`` copes with a half start-up)."""
    daemon = ControllerDaemon(config, clock)
    try:
        daemon.startup()
        yield daemon
    finally:
        daemon.shutdown()


@contextmanager
def running_daemon(
    redis_url: str | None,
    folder: Path,
    policy: str | Path | None = None,
    clock: Callable[[], float] = time.time,
    **settings: Any,
) -> Iterator[ControllerDaemon]:
    """``running(daemon_config(...))``, then the keys under its prefix deleted (with an external Redis)."""
    config = daemon_config(redis_url, folder, policy, **settings)
    try:
        with running(config, clock) as daemon:
            yield daemon
    finally:
        if redis_url is not None:
            forget_keys(redis_url, config.learning.prefix)


def forget_keys(redis_url: str, prefix: str) -> None:
    client = make_client(redis_url, 2.0)
    try:
        keys = list(client.scan_iter(f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@contextmanager
def connected(daemon: ControllerDaemon) -> Iterator[grpc.Channel]:
    """A channel to ``daemon``, ready."""
    with grpc.insecure_channel(daemon.address) as channel:
        grpc.channel_ready_future(channel).result(timeout=RPC_TIMEOUT)
        yield channel


def ipv6_loopback() -> bool:
    """Can this machine bind ::1? (A daemon listening on ``localhost`` then takes calls from two hosts: 127.0.0.1
    and ::1.)"""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False
