"""The controller daemon's configuration (configs/controller.yaml), parsed once at start-up.

Relative paths in the file (the file exporter's endpoint among them) are resolved against the file's own
folder. ``SPECD_REDIS_URL`` in the environment overrides ``redis_url`` (so a password can live in a systemd
EnvironmentFile); ``redis_tls`` holds the CA (and client certificate) for a ``rediss://`` URL. ``tls:`` and ``auth:``
lock the gRPC port down (serving/auth.py). Every certificate and token file is checked, and the tokens read, when
the file is loaded. ``metrics.listen`` opens the Prometheus endpoint (serving/metrics_endpoint.py); off by default.
``learning.report_aggregates_per_second_per_peer`` is each client host's budget of report work
(controller/serving/report_budget.py).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator, model_validator

from controller.serving.host_share import DEFAULT_CALLS_PER_HOST
from controller.serving.report_budget import DEFAULT_MAX_PEERS, MAX_HOLD_SECONDS, SEGMENT_COST, ReportBudget
from controller.serving.table_publisher import MAX_DRAFTER_SETS, MAX_DRAFTER_SETS_PER_HOST
from controller.storage.redis_conn import RedisTls, uses_tls
from controller.storage.store import StoreConfig
from specd_api.checks import MAX_AGGREGATES
from specd_api.config_base import Strict, TelemetryConfig
from specd_api.security import Secret, ServerTls
from specd_api.yaml_config import load_yaml_model


class LearningConfig(Strict):
    prefix: str = Field("specd", pattern=r"^[A-Za-z0-9_.-]{1,32}$", description="Redis key prefix")
    bucket_seconds: float = Field(60.0, gt=0)
    half_life_seconds: float = Field(600.0, gt=0, description="weight of a count halves over this age")
    window_buckets: int = Field(60, ge=1, le=10_000)
    max_segments: int = Field(1000, ge=1, description="distinct segments before new ones share _overflow")
    refresh_seconds: float = Field(1.0, gt=0, description="how often decisions see new telemetry")
    prior_retrain_seconds: float = Field(60.0, gt=0)
    report_ttl_seconds: int = Field(
        3600, ge=60, description="how long a report id is remembered: a retry later than this would count again"
    )
    samples_max: int = Field(20_000, ge=100, description="feature rows kept in Redis for the prior model")
    journal_max_reports: int = Field(100_000, ge=1, description="reports kept locally while Redis is down")
    journal_max_bytes: int = Field(
        16 * 2**20, ge=4096, description="the journal's size bound; a report past it gets RESOURCE_EXHAUSTED"
    )
    report_aggregates_per_second_per_peer: float = Field(
        4000.0, ge=0, allow_inf_nan=False,
        description="the report budget: aggregates a second each client host (IP) may report; a report over it gets "
        "RESOURCE_EXHAUSTED before any work (the worker retries it). 0: no budget",
    )  # fmt: skip
    report_aggregates_burst_per_peer: int = Field(
        MAX_AGGREGATES * (1 + SEGMENT_COST), ge=MAX_AGGREGATES,
        description="the most report work a client host may send at once (its bucket's size, in aggregates; a "
        "segment past a report's first counts SEGMENT_COST more): by default a report at the size bound over as "
        "many segments; a report never costs more than the bucket, so one always passes a full bucket",
    )  # fmt: skip
    report_budget_hold_seconds: float = Field(
        1.0, ge=0, le=MAX_HOLD_SECONDS, allow_inf_nan=False,
        description="the longest a client host's report is held before it is read, until its budget holds what its "
        "last report cost: a client sending back to back is paced, not refused after its report was parsed. 0: "
        "never held",
    )  # fmt: skip
    report_budget_max_peers: int = Field(
        DEFAULT_MAX_PEERS, ge=1, le=1_000_000, description="client hosts whose budget is kept (least recently seen "
        "out first; one that comes back starts with a full bucket)",
    )  # fmt: skip

    def store_config(self) -> StoreConfig:
        return StoreConfig(
            prefix=self.prefix,
            bucket_seconds=self.bucket_seconds,
            half_life_seconds=self.half_life_seconds,
            window_buckets=self.window_buckets,
            max_segments=self.max_segments,
            report_ttl_seconds=self.report_ttl_seconds,
            samples_max=self.samples_max,
            decay_step_seconds=self.bucket_seconds,  # decay moves with the window, once a bucket
        )

    def report_budget(self) -> ReportBudget | None:
        """The per-peer budget of report work (controller/serving/report_budget.py); None when it is off."""
        rate = self.report_aggregates_per_second_per_peer
        if rate == 0:
            return None
        return ReportBudget(rate, self.report_aggregates_burst_per_peer, self.report_budget_max_peers,
                            max_hold_seconds=self.report_budget_hold_seconds)  # fmt: skip


class TokenAuth(Strict):
    """Bearer tokens on the gRPC port; none set: no token is asked for. The write token opens every RPC; the read
    token only those that change nothing (controller/serving/auth.py has the table). Health checks stay open."""

    read_token: Secret | None = Field(None, description="opens Decide, GetSegmentStats, ListSegments, GetPolicy, "
                                                        "GetCosts")  # fmt: skip
    write_token: Secret | None = Field(None, description="opens every RPC, ReportRounds and ReloadPolicy included")

    @model_validator(mode="after")
    def _roles(self) -> TokenAuth:
        if self.read_token is None:
            return self
        if self.write_token is None:
            raise ValueError("read_token needs a write_token too: without one, every ReportRounds would be refused")
        if self.read_token.reveal() == self.write_token.reveal():
            raise ValueError("read_token and write_token are the same token: a reader could write")
        return self


class MetricsConfig(Strict):
    """The Prometheus endpoint: GET /metrics over plain HTTP, with no token (controller/serving/metrics_endpoint.py)."""

    listen: str | None = Field(
        None, description="host:port ([v6]:port) to serve GET /metrics on (port 0 picks a free one); null: off"
    )
    max_scrape_seconds: float = Field(
        2.0, gt=0, le=60, description="a scrape stops reading segments after this long; the rest wait for the next"
    )

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str | None) -> str | None:
        if value is not None:
            split_host_port(value)
        return value

    @property
    def host(self) -> str:
        assert self.listen is not None, "metrics are off"
        return split_host_port(self.listen)[0]

    @property
    def port(self) -> int:
        assert self.listen is not None, "metrics are off"
        return split_host_port(self.listen)[1]


def split_host_port(listen: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port), the brackets off; a ValueError saying what is wrong."""
    host, colon, port = listen.rpartition(":")
    if not colon or not host:
        raise ValueError(f"must be host:port (port 0 picks a free one), got {listen[:80]!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{host[:80]!r} in brackets is not an IPv6 address") from None
    elif ":" in host or "[" in host or "]" in host:
        raise ValueError(f"an IPv6 address is written [address]:port, got {listen[:80]!r}")
    if any(c.isspace() or c == "/" for c in host):
        raise ValueError(f"{host[:80]!r} is not a host name or IP address")
    if not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise ValueError(f"the port must be a number in 0..65535 (0 picks a free one), got {port[:20]!r}")
    return host, int(port)


class ControllerConfig(Strict):
    listen: str = Field("127.0.0.1:50061", description="host:port for gRPC (port 0 picks a free one)")
    redis_url: str | None = Field(None, description="redis://, rediss:// or unix://; none starts an embedded server")
    redis_tls: RedisTls | None = Field(None, description="for a rediss:// URL: the CA its certificate chains to, and "
                                                          "a client certificate if it asks for one")  # fmt: skip
    redis_timeout_seconds: float = Field(0.5, gt=0)
    policy_path: Path = Path("../policies/default.yaml")
    state_dir: Path = Path("../.specd/controller")
    max_workers: int = Field(16, ge=1, le=1024, description="threads answering unary RPCs (Decide, ReportRounds, ...)")
    max_watchers: int = Field(
        256, ge=0, le=4096,
        description="WatchDecisions streams served at once (each holds a thread of its own); more are refused with "
        "RESOURCE_EXHAUSTED, and those workers ask Decide",
    )  # fmt: skip
    max_watchers_per_host: int = Field(
        64, ge=1, le=4096,
        description="WatchDecisions streams one client host (IP address) holds at once (a worker holds one); more "
        "are refused with RESOURCE_EXHAUSTED, so that one host cannot take every max_watchers slot",
    )  # fmt: skip
    max_drafter_sets: int = Field(
        MAX_DRAFTER_SETS, ge=1, le=64,
        description="drafter sets (the drafters a worker offers) whose decision tables are kept at once, each built "
        "and kept at every refresh; a stream of another set is then refused with RESOURCE_EXHAUSTED, and its worker "
        "asks Decide",
    )  # fmt: skip
    max_drafter_sets_per_host: int = Field(
        MAX_DRAFTER_SETS_PER_HOST, ge=1, le=64,
        description="drafter sets one client host's WatchDecisions streams may watch at once (a worker watches one), "
        "so that one host cannot take every max_drafter_sets place or multiply the tables' work",
    )  # fmt: skip
    max_calls_per_host: int = Field(
        DEFAULT_CALLS_PER_HOST, ge=1, le=1024,
        description="unary calls one client host (IP address) has running at once; its others wait their turn, "
        "holding no thread, so that one host's flood shares the controller with the other hosts",
    )  # fmt: skip
    report_process: bool = Field(
        True,
        description="validate and store reports in a child process at a lower priority, so that their work never "
        "holds the interpreter Decide needs (controller/serving/report_process.py); false: in the daemon",
    )
    shutdown_grace_seconds: float = Field(10.0, ge=0)
    policy_watch_seconds: float = Field(2.0, gt=0, description="how often the policy file is checked")
    redis_restart_backoff_seconds: tuple[float, float] = Field(
        (0.5, 30.0), description="an embedded Redis that dies is restarted after min seconds, doubling up to max"
    )
    learning: LearningConfig = Field(default_factory=lambda: LearningConfig())
    telemetry: TelemetryConfig = Field(default_factory=lambda: TelemetryConfig())
    tls: ServerTls | None = Field(None, description="null: plaintext; set: TLS (with client_ca_file: mutual TLS)")
    auth: TokenAuth = Field(default_factory=lambda: TokenAuth())
    metrics: MetricsConfig = Field(default_factory=lambda: MetricsConfig())

    @field_validator("redis_tls")
    @classmethod
    def _redis_tls_needs_tls(cls, value: RedisTls | None, info: ValidationInfo) -> RedisTls | None:
        # A null redis_url may still become a rediss:// one from SPECD_REDIS_URL: connect() checks that case.
        url = info.data.get("redis_url")
        if value is not None and url is not None and not uses_tls(url):
            raise ValueError(f"redis_url's scheme is {url.split('://', 1)[0]}://, not rediss:// (or "
                             "rediss+cluster://): these certificates would never be used")  # fmt: skip
        return value

    @field_validator("redis_restart_backoff_seconds")
    @classmethod
    def _backoff(cls, value: tuple[float, float]) -> tuple[float, float]:
        low, high = value
        if not (0 < low <= high < float("inf")):
            raise ValueError(f"must be [min, max] with 0 < min <= max, got {list(value)}")
        return value


def load_config(path: str | Path) -> ControllerConfig:
    """Read the config; raises ConfigError (file, line, field) when invalid."""
    config, _ = load_yaml_model(path, ControllerConfig)
    return resolve(config, Path(path).resolve().parent)


def resolve(config: ControllerConfig, base: Path) -> ControllerConfig:
    """Relative paths against ``base``; the environment's SPECD_REDIS_URL over the file's redis_url."""
    return config.model_copy(
        update={
            "policy_path": base / config.policy_path,
            "state_dir": base / config.state_dir,
            "redis_url": os.environ.get("SPECD_REDIS_URL") or config.redis_url,
            "telemetry": config.telemetry.resolve(base),
        }
    )
