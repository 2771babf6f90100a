"""The worker's configuration (configs/worker.yaml), parsed once at start-up.

Relative paths (models, the file exporter's endpoint, certificates and token files) are resolved against the file's
own folder. Certificate, key and token files are checked, and the tokens read, when the file is loaded.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, field_validator, model_validator

from decoder.choices import MAX_BRANCHES
from decoder.worker.segments import CLASSIFIER_SEGMENTS
from specd_api.config_base import Strict, TelemetryConfig
from specd_api.errors import UsageError
from specd_api.security import ClientTls, ControllerCredentials, Secret
from specd_api.segments import SEGMENT_PATTERN
from specd_api.targets import check_address, parse_target
from specd_api.yaml_config import load_yaml_model

if TYPE_CHECKING:
    from decoder.drafters.suffix_cache import SuffixConfig


class ControllerLink(Strict):
    address: str | None = Field(
        "127.0.0.1:50061",
        description="the controller's host:port, or replicas as IP:port,IP:port (round_robin); null: no controller",
    )
    decide_deadline_ms: float = Field(5.0, gt=0, le=10_000)
    default_drafter: Literal["draft", "prompt_lookup", "none"] = "none"
    default_k: int = Field(0, ge=0, le=32, description="the local plan's K ceiling")
    report_interval_seconds: float = Field(0.5, gt=0)
    watch_decisions: bool = Field(
        False, description="keep the controller's decision tables (WatchDecisions) and decide locally where they "
        "hold; Decide only for segments they lack (docs/SCALING.md)",
    )  # fmt: skip
    max_buffered_aggregates: int = Field(10_000, ge=1)
    tls: ClientTls | None = Field(None, description="null: plaintext; set: TLS (with cert_file/key_file: mutual TLS)")
    token: Secret | None = Field(None, description="sent as 'authorization: Bearer'; the controller's write token "
                                                   "(a worker reports rounds)")  # fmt: skip

    def credentials(self) -> ControllerCredentials | None:
        if self.tls is None and self.token is None:
            return None
        return ControllerCredentials(tls=self.tls, token=self.token)

    @field_validator("address")
    @classmethod
    def _address_is_a_target(cls, address: str | None) -> str | None:
        if address is not None:
            parse_target(address, "")
        return address

    @model_validator(mode="after")
    def _address_dialable_with_tls(self) -> ControllerLink:
        if self.address is not None:
            server_name = self.tls.server_name if self.tls is not None else None
            check_address(self.address, "address", server_name, self.tls is not None)
        return self

    @model_validator(mode="after")
    def _default_k_fits_drafter(self) -> ControllerLink:
        if (self.default_drafter == "none") != (self.default_k == 0):
            raise ValueError("default_k must be 0 exactly when default_drafter is none")
        return self


Access = Literal["open", "protected"]


class TenantKey(Strict):
    """A tenant's API key and the segments it may name. Its requests that name none are learned under
    ``<name>/<inferred segment>``, so no other key's traffic reaches them."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,48}$", description="the prefix of its inferred segments")
    key: Secret
    segments: list[str] = Field(
        min_length=1, max_length=64, description="globs of the segment names its requests may name"
    )

    @field_validator("segments")
    @classmethod
    def _globs(cls, globs: list[str]) -> list[str]:
        for glob in globs:
            if not 1 <= len(glob) <= 128:
                raise ValueError(f"a segment glob is 1 to 128 characters, got {len(glob)}")
        return globs

    def allows(self, segment: str) -> bool:
        return any(fnmatch.fnmatchcase(segment, glob) for glob in self.segments)


class ApiAuth(Strict):
    """API keys for the HTTP API, OpenAI style (``Authorization: Bearer <key>``); none: every route is open.
    With a key, every route needs one but /health and /metrics, which are each ``open`` or ``protected``.

    ``api_key`` is the operator's: its requests may name any segment, as every request may without keys (one
    tenant). Each of ``tenants`` is bound to the segments it may name (a request naming another is refused, 403),
    and its requests that name none are learned under its own prefix."""

    api_key: Secret | None = Field(None, description="a file or an environment variable holding the key")
    tenants: list[TenantKey] = Field(default_factory=list, max_length=1024)
    health: Access = Field("open", description="/health: open by default, for load balancers and probes")
    metrics: Access = Field("protected", description="/metrics: Prometheus sends the key with `authorization:`")

    @model_validator(mode="after")
    def _distinct(self) -> ApiAuth:
        names = [t.name for t in self.tenants]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"tenants: the name {name!r} is given twice")
        keys = [t.key.reveal() for t in self.tenants] + ([self.api_key.reveal()] if self.api_key else [])
        if len(set(keys)) != len(keys):
            raise ValueError("tenants: two credentials hold the same key (each key names one tenant)")
        return self

    def credentials(self) -> dict[str, TenantKey | None]:
        """Each key, with the tenant it names (None: the operator's ``api_key``)."""
        out: dict[str, TenantKey | None] = {t.key.reveal(): t for t in self.tenants}
        if self.api_key is not None:
            out[self.api_key.reveal()] = None
        return out


class WorkerTelemetry(TelemetryConfig):
    service_name: str = "specd-worker"


class PromptLookupSettings(Strict):
    min_ngram: int = Field(1, ge=1, le=16)
    max_ngram: int = Field(3, ge=1, le=16)
    branches: int = Field(1, ge=1, le=MAX_BRANCHES)  # matches a round verifies together as a tree (1: a chain)

    @model_validator(mode="after")
    def _ordered(self) -> PromptLookupSettings:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
        return self


class SuffixSettings(Strict):
    """Suffix decoding (decoder/drafters/suffix.py) and the worker's cache of served outputs it proposes from."""

    depth: int = Field(16, ge=2, le=64, description="tokens per suffix-trie path: the longest match")
    min_probability: float = Field(0.1, ge=0.0, le=1.0, description="a proposal ends where the observed frequency "
                                   "of its continuation falls under this")  # fmt: skip
    max_tokens_per_match_token: float = Field(1.0, gt=0.0, le=64.0, description="proposed tokens per matched token")
    own_window: int = Field(2048, ge=1, description="tokens of a request's own text indexed (the prompt's tail, "
                            "then its output)")  # fmt: skip
    cache_bytes: int = Field(64 << 20, ge=0, description="the cache of served outputs, in bytes (0: none)")
    max_segment_share: float = Field(0.5, gt=0.0, le=1.0, description="the most of cache_bytes one segment holds")
    private_segments: list[str] = Field(
        default_factory=list, max_length=1000, description="segments (names or globs) whose outputs never enter the "
        "cache, whatever a request says (share_outputs: false does it per request)",
    )  # fmt: skip
    # Replaying suffix decoding over a request another drafter served costs 1.3-4.9 ms with the reference target,
    # 1.7% of its decode time (median; p90 2.4%, docs/ARCHITECTURE.md): a quarter of the requests keep that at 0.4%.
    counterfactual_share: float = Field(0.25, ge=0.0, le=1.0, description="of the requests the controller asks "
                                        "suffix decoding scored over, the share scored (after the answer)")  # fmt: skip

    def config(self) -> SuffixConfig:
        from decoder.drafters.suffix_cache import SuffixConfig  # torch comes with the drafters: not at config load

        return SuffixConfig(self.depth, self.min_probability, self.max_tokens_per_match_token, self.own_window,
                            self.cache_bytes, self.max_segment_share)  # fmt: skip

    def is_private(self, segment: str) -> bool:
        return any(fnmatch.fnmatchcase(segment, pattern) for pattern in self.private_segments)


class RequestLimits(Strict):
    """Bounds on one request, checked before the work they bound: the body before JSON parsing (chunked bodies
    included), a text prompt's characters before tokenizing, a prompt's tokens before queueing; and on what a
    connection holds (decoder/worker/connections.py)."""

    max_request_bytes: int = Field(1 << 20, ge=1024, description="request body, in bytes; larger gets 413")
    max_prompt_chars: int = Field(
        200_000, ge=1, description="characters of a text prompt (a chat's message texts together)"
    )
    max_prompt_tokens: int = Field(32_768, ge=1, description="tokens of a prompt, given as ids or tokenized")
    request_read_seconds: float = Field(
        30.0, gt=0, le=3600, description="a request's head and body must arrive whole within this, from the "
        "connection's opening or its previous response; else the connection is closed",
    )  # fmt: skip
    keep_alive_seconds: int = Field(5, ge=1, le=3600, description="an idle connection is closed after this")
    max_header_bytes: int = Field(16_384, ge=1024, description="a request's head (request line and headers); "
                                  "larger gets 400")  # fmt: skip
    max_connections: int = Field(4096, ge=1, description="connections served at once; a request beyond gets 503")
    max_connections_per_host: int = Field(
        256, ge=0, description="connections from one client address at once; one beyond gets 503 and is closed "
        "(0: no bound). One host's 4,200 idle connections took every place of max_connections: every other client "
        "got 503. Raise it for a proxy in front that carries every client's connections",
    )  # fmt: skip


class ClientSpeculation(Strict):
    """What a client may choose with the request's ``speculation`` field (a drafter and K for its own request)."""

    allowed: bool = Field(True, description="false: a request naming its speculation gets 400")
    max_k: int = Field(
        8, ge=0, le=64, description="the largest K a client may ask for (the default policy's k_max for the draft "
        "model): each drafted token is verified in the batch's target pass, so four clients at K=64 make every other "
        "request ~11x slower than four at K=0; at 8, ~1.8x",
    )  # fmt: skip


class ClientSegments(Strict):
    """Which traffic segments a client may name (the request's ``segment`` field or X-Specd-Segment header). Every
    segment a worker reports holds one of the controller's ``learning.max_segments`` places for a whole learning
    window: a client naming a new segment per request could fill them all, and every later new segment would learn
    only as ``_overflow`` for an hour."""

    allowed: bool = Field(True, description="false: a request naming a segment gets 400")
    names: list[str] = Field(
        default_factory=lambda: ["*"], min_length=1, max_length=1000,
        description="globs a segment a client names must match, else 400 (default: any name)",
    )  # fmt: skip
    max_names: int = Field(
        100, ge=0, le=100_000, description="client-named segments this worker holds at once (each holds one of the "
        "controller's learning.max_segments places); past it a request naming another is served under the segment "
        "the worker infers, counted in specd_worker_client_segments_ignored_total (0: no bound)",
    )  # fmt: skip
    max_names_per_host: int = Field(
        25, ge=1, le=100_000, description="of them, brought by one client address (raise it for a proxy in front, "
        "which carries every client's requests)",
    )  # fmt: skip
    new_host_share: float = Field(
        0.25, ge=0.0, lt=1.0, description="this share of max_names is kept for addresses that hold no name yet: an "
        "address holding names takes a new place only while more than that many are free",
    )  # fmt: skip
    window_seconds: float = Field(
        3600.0, gt=0, le=30 * 86_400, description="a name no request names for this long gives its place back (the "
        "controller's learning window: window_buckets x bucket_seconds)",
    )  # fmt: skip


class MetricsSettings(Strict):
    max_segments: int = Field(
        100, ge=1, description="segment label values on /metrics; traffic of later segments is counted as _overflow"
    )


class FaultInjection(Strict):
    """Faults the worker puts into its own work on purpose, to measure robustness (``specd bench --noise``); off by
    default. Never set it on a worker that serves real traffic."""

    stall_share: float = Field(
        0.0, ge=0.0, le=1.0, description="the share of requests stalled once, inside the timed target pass of their "
        "second round (what the round's timing and the controller's telemetry see); 0: off",
    )  # fmt: skip
    stall_ms: float = Field(0.0, ge=0.0, le=600_000.0, description="each stall, in milliseconds")
    seed: int = Field(0, description="seeds which requests are stalled (the same seed and traffic: the same ones)")


class WorkerConfig(Strict):
    listen: str = Field("127.0.0.1:8000", description="host:port for HTTP (port 0 picks a free one)")
    worker_id: str | None = Field(None, description="reported to the controller; default: hostname:port")
    target: Path = Path("../models/reference/target")
    draft: Path | None = Path("../models/reference/draft")
    head: Path | None = Field(
        None, description="a draft head for the target (speculators layout, decoder/heads): offers the eagle drafter"
    )
    model_name: str = Field("specd-reference", min_length=1, description="the name /v1/models lists")
    device: str = "auto"
    dtype: Literal["auto", "float32", "float16", "bfloat16", "float64"] = Field(
        "auto", description="auto: float32 on a CPU (the native pass, exact), bfloat16 on a GPU that has it"
    )
    runner: Literal["auto", "native", "lean", "invariant", "graphs", "transformers"] = Field(
        "auto", description="the model forward (README, 'The native pass'); invariant: batch-invariant in any dtype, "
        "so greedy speculative output equals target-only output in bfloat16 on a GPU too; graphs: the same exactness "
        "in CUDA graphs (auto's choice on a GPU)",
    )  # fmt: skip
    threads: int | None = Field(None, ge=1, description="torch threads; null: torch's default")
    max_batch: int = Field(16, ge=1, le=256, description="sequences decoded together")
    warm_up: bool = Field(
        True, description="before serving, capture the graphs pass's CUDA graphs (on a GPU) and decode a few rounds of "
        "every drafter, K and batch size 1/2/4 (not reported): first passes run slower, and the controller would learn "
        "that as cost",
    )  # fmt: skip
    speculation_max_batch: int = Field(
        8,
        ge=0,
        description="the batch threshold of a plan that carries none (the policy's is in the decision): "
        "above this batch size, decode without speculation",
    )
    max_queue: int = Field(64, ge=0, description="requests waiting for a slot before new ones get 429")
    request_timeout_seconds: float = Field(300.0, gt=0)
    default_max_tokens: int = Field(64, ge=1)
    max_tokens_limit: int = Field(2048, ge=1)
    default_segment: str = Field("default", pattern=SEGMENT_PATTERN)
    segment_classifier: Literal["none", "heuristic"] = Field(
        "heuristic", description="infer the segment of a request that names none; none: use default_segment"
    )
    shutdown_grace_seconds: float = Field(10.0, ge=0)
    prompt_lookup: PromptLookupSettings = Field(default_factory=lambda: PromptLookupSettings())
    suffix: SuffixSettings = Field(default_factory=lambda: SuffixSettings())
    limits: RequestLimits = Field(default_factory=lambda: RequestLimits())
    client_speculation: ClientSpeculation = Field(default_factory=lambda: ClientSpeculation())
    client_segments: ClientSegments = Field(default_factory=lambda: ClientSegments())
    metrics: MetricsSettings = Field(default_factory=lambda: MetricsSettings())
    controller: ControllerLink = Field(default_factory=lambda: ControllerLink())
    auth: ApiAuth = Field(default_factory=lambda: ApiAuth())
    telemetry: WorkerTelemetry = Field(default_factory=lambda: WorkerTelemetry())
    fault_injection: FaultInjection = Field(
        default_factory=lambda: FaultInjection(), description="stalls injected on purpose (benchmarks); default off"
    )

    @model_validator(mode="after")
    def _tenant_segments_fit(self) -> WorkerConfig:
        longest = max((self.default_segment, *CLASSIFIER_SEGMENTS), key=len)
        for tenant in self.auth.tenants:
            if len(tenant.name) + 1 + len(longest) > 128:
                raise ValueError(f"auth.tenants[{tenant.name}]: its inferred segments ({tenant.name}/{longest}) "
                                 "would pass the 128 characters of a segment name")  # fmt: skip
        return self

    def resolve(self, base: Path) -> WorkerConfig:
        """Relative paths against ``base`` (the config file's folder)."""
        return self.model_copy(
            update={
                "target": base / self.target.expanduser(),
                "draft": base / self.draft.expanduser() if self.draft is not None else None,
                "head": base / self.head.expanduser() if self.head is not None else None,
                "telemetry": self.telemetry.resolve(base),
            }
        )


def load_worker_config(path: str | Path) -> WorkerConfig:
    """Read the config; raises ConfigError (file, line, field) when invalid."""
    config, _ = load_yaml_model(path, WorkerConfig)
    return config.resolve(Path(path).resolve().parent)


def split_address(listen: str) -> tuple[str, int]:
    """``host:port``, the host of an IPv6 address in brackets (``[::]:8000``, every address of both families)."""
    host, _, port = listen.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or not port.isdigit():
        raise UsageError(f"listen address must be host:port, got {listen!r}")
    return host, int(port)
