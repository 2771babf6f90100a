"""Real processes for the end-to-end tests: the controller (with its embedded Redis) and the decode worker on
the shipped reference pair, each started as ``specd ...`` from a config written into the test's tmp_path.

``stack`` starts them on demand and stops whatever is still running at the end of the test, including an
embedded Redis that a SIGKILLed controller left behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from controller.storage.redis_conn import PID_FILE, stop_orphan
from specd.launch import Service, start

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "models" / "reference"
POLICY = ROOT / "policies" / "default.yaml"
FORCED_RULE = '\n  - match: "adversarial*"\n    force: none\n'  # the tests' policy switches adversarial* off


def otlp_telemetry(endpoint: str, service_name: str) -> dict[str, Any]:
    return {"exporter": "otlp_grpc", "endpoint": endpoint, "service_name": service_name}


@dataclass
class Stack:
    """Starts services for one test; ``close`` stops them (newest first)."""

    root: Path
    services: list[Service] = field(default_factory=list)

    @property
    def controller_state(self) -> Path:
        return self.root / "controller-state"

    def start_controller(
        self, listen: str = "127.0.0.1:0", telemetry: dict[str, Any] | None = None, policy: str | None = None,
        **learning: Any,
    ) -> Service:  # fmt: skip
        """The daemon with its own state_dir (embedded Redis, journal). A half-life of 1e12 s makes decayed counts
        the raw counts: a bucket a minute old weighs 1 - 4e-11 (1e9 would leave 4e-8, too much for comparing α to
        1e-9). A short refresh lets decisions see reports quickly. ``policy``: the policy's text (default: the shipped
        one), to which a rule is added; ``learning``: more of its ``learning`` settings."""
        path = self.root / "policy.yaml"  # the policy, plus a rule to show rules work end to end
        path.write_text((POLICY.read_text() if policy is None else policy) + FORCED_RULE)
        config = {
            "listen": listen,
            "redis_url": None,
            "policy_path": str(path),
            "state_dir": str(self.controller_state),
            "shutdown_grace_seconds": 2,
            "learning": {"half_life_seconds": 1e12, "refresh_seconds": 0.2, **learning},
            "telemetry": telemetry or {"exporter": "none"},
        }
        path = self._write("controller", config)
        return self._start("controller", ["controller", "--config", str(path)], traced=telemetry is not None)

    def start_worker(
        self,
        controller: str | None,
        decide_deadline_ms: float = 5.0,
        telemetry: dict[str, Any] | None = None,
        watch_decisions: bool = False,
        **settings: Any,
    ) -> Service:
        """The worker on the reference pair (float32 on the CPU); ``controller`` None runs it without one.
        ``settings``: more of its top-level settings."""
        config = {
            "listen": "127.0.0.1:0",
            "target": str(REFERENCE / "target"),
            "draft": str(REFERENCE / "draft"),
            "device": "cpu",
            "dtype": "float32",
            "shutdown_grace_seconds": 1,  # also bounds the flush of reports to a controller a test killed
            "controller": {
                "address": controller,
                "decide_deadline_ms": decide_deadline_ms,
                "report_interval_seconds": 0.2,
                "watch_decisions": watch_decisions,
            },
            "telemetry": telemetry or {"exporter": "none"},
            **settings,
        }
        path = self._write("worker", config)
        args = ["worker", "--config", str(path), "--controller", controller or "none"]
        return self._start("worker", args, traced=telemetry is not None)

    def close(self) -> None:
        for service in reversed(self.services):
            service.stop(timeout_seconds=15)
        # a controller that was SIGKILLed (and not restarted) leaves its embedded Redis running
        stop_orphan(self.controller_state / "redis" / PID_FILE)

    def _write(self, name: str, config: dict[str, Any]) -> Path:
        path = self.root / f"{name}-{len(self.services)}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def _start(self, name: str, args: list[str], traced: bool) -> Service:
        log = self.root / f"{name}-{len(self.services)}.log"
        # spans leave in batches every 5 s by default; a test should not wait that long for them
        env = {"OTEL_BSP_SCHEDULE_DELAY": "100"} if traced else None
        service = start(name, args, log_path=log, env=env, cwd=ROOT, timeout_seconds=180)
        self.services.append(service)
        return service


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    services = Stack(tmp_path)
    try:
        yield services
    finally:
        services.close()
