"""The demo's own configuration files, written into its run folder: every key of configs/controller.yaml and
configs/worker.yaml, with absolute paths, free ports, traces to files, and learning fast enough to move
within a few minutes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "models" / "reference"


@dataclass(frozen=True)
class DemoPaths:
    """Where one run keeps everything."""

    run: Path

    @property
    def configs(self) -> Path:
        return self.run / "configs"

    @property
    def logs(self) -> Path:
        return self.run / "logs"

    @property
    def plot(self) -> Path:
        return self.run / "demo.png"

    @property
    def summary(self) -> Path:
        return self.run / "summary.json"

    def config(self, service: str) -> Path:
        return self.configs / f"{service}.yaml"

    def log(self, service: str) -> Path:
        return self.logs / f"{service}.log"

    def traces(self, service: str) -> Path:
        return self.run / f"traces-{service}.jsonl"


def controller_config(paths: DemoPaths, policy: Path) -> dict[str, Any]:
    return {
        "listen": "127.0.0.1:0",
        "redis_url": None,  # the embedded server, under state_dir
        "redis_timeout_seconds": 0.5,
        "policy_path": str(policy.resolve()),
        "state_dir": str(paths.run / "controller-state"),
        "shutdown_grace_seconds": 5,
        "learning": {
            "prefix": "specd",
            "bucket_seconds": 10,
            "half_life_seconds": 120,  # the demo lasts minutes: let its own traffic dominate
            "window_buckets": 60,
            "max_segments": 1000,
            "refresh_seconds": 0.5,  # decisions see new telemetry within half a second
        },
        "telemetry": {
            "exporter": "file",
            "endpoint": str(paths.traces("controller")),
            "service_name": "specd-controller",
        },
    }


def worker_config(paths: DemoPaths, service: str, target: Path, draft: Path | None) -> dict[str, Any]:
    """``service`` names the trace file and the service; the controller address is given on the command line."""
    return {
        "listen": "127.0.0.1:0",
        "target": str(target.resolve()),
        "draft": str(draft.resolve()) if draft is not None else None,
        "model_name": "specd-reference",
        "device": "auto",
        "dtype": "float32",
        "max_batch": 16,
        "speculation_max_batch": 8,
        "max_queue": 64,
        "request_timeout_seconds": 300,
        "default_max_tokens": 64,
        "max_tokens_limit": 2048,
        "default_segment": "default",
        "segment_classifier": "heuristic",
        "shutdown_grace_seconds": 10,
        "prompt_lookup": {"min_ngram": 1, "max_ngram": 3},
        "client_speculation": {"max_k": 16},  # the bench's static arms run K up to 12 (specd/bench/measure.py)
        "controller": {
            "address": None,  # --controller ADDRESS|none on the command line
            "decide_deadline_ms": 5,
            "default_drafter": "none",  # no speculation unless the controller says otherwise
            "default_k": 0,
            "report_interval_seconds": 0.5,
            "max_buffered_aggregates": 10000,
            # decide locally from the controller's pushed tables where they hold (a learned segment): no Decide call
            # before the prefill, so the first token waits for nothing the controller does
            "watch_decisions": True,
        },
        "telemetry": {"exporter": "file", "endpoint": str(paths.traces(service)), "service_name": f"specd-{service}"},
    }


def write_config(path: Path, config: dict[str, Any], comment: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {comment}\n" + yaml.safe_dump(config, sort_keys=False))
    return path


AA_PREFIX = "aa/"  # the A/A's segments: the demo's and the bench's policies never speculate for them


def with_off_rule(policy: dict[str, Any], off_prefix: str = AA_PREFIX) -> dict[str, Any]:
    """``policy`` with one rule in front: segments named ``off_prefix*`` never speculate (the A/A's traffic). Among
    glob rules the first listed wins, so nothing can override it."""
    rule = {"match": f"{off_prefix}*", "force": "none"}
    return {**policy, "segments": [rule, *(policy.get("segments") or [])]}


def demo_policy(policy: Path, off_prefix: str = AA_PREFIX) -> dict[str, Any]:
    """The user's policy file with the A/A's rule in front (``with_off_rule``)."""
    return with_off_rule(yaml.safe_load(policy.read_text()) or {}, off_prefix)


def uncontrolled_worker_config(config: dict[str, Any]) -> dict[str, Any]:
    """A worker's config with no controller: it decides by its local default (no speculation) and reports nothing:
    the worker a user compares with."""
    link = {**config.get("controller", {}), "address": None, "default_drafter": "none", "default_k": 0}
    return {**config, "controller": link}
