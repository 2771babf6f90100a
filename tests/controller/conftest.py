"""Redis for controller tests: the embedded server (always; tests/conftest.py), and the local Redis at
127.0.0.1:6379 when one answers. Every test gets its own key prefix, so runs never see each other's keys.

And a running daemon each module may share (``daemon``, from tests/daemons.py); a module that needs another setup
defines its own ``daemon``."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
import redis

from controller.server import ControllerDaemon
from controller.storage.redis_conn import make_client
from tests.daemons import DEFAULT_POLICY, FORCED_OFF_RULE, running_daemon

LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"


def _local_redis_available() -> bool:
    try:
        return bool(make_client(LOCAL_REDIS_URL, 0.5).ping())
    except redis.RedisError:
        return False


@pytest.fixture(params=["embedded", "local"])
def redis_url(request, embedded_redis_url) -> str:
    """Both servers; the local one is skipped (with the reason) when nothing listens on 6379."""
    if request.param == "embedded":
        return embedded_redis_url
    if not _local_redis_available():
        pytest.skip("no Redis at 127.0.0.1:6379 on this machine")
    return LOCAL_REDIS_URL


@pytest.fixture
def redis_client(redis_url) -> Iterator[redis.Redis]:
    client = make_client(redis_url, 2.0)
    yield client
    client.close()


@pytest.fixture
def prefix(redis_client) -> Iterator[str]:
    """A fresh key prefix; its keys are deleted afterwards."""
    name = f"t{uuid.uuid4().hex[:12]}"
    yield name
    keys = list(redis_client.scan_iter(f"{name}:*", count=1000))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture(scope="module")
def daemon(embedded_redis_url, tmp_path_factory) -> Iterator[ControllerDaemon]:
    """The module's daemon over the embedded Redis: the default policy plus one rule that switches `forced-off*`
    segments off. Tests share it, so each uses segment names of its own."""
    policy = DEFAULT_POLICY.read_text() + FORCED_OFF_RULE
    with running_daemon(embedded_redis_url, tmp_path_factory.mktemp("daemon"), policy) as d:
        yield d
