"""The controller at scale and beside hostile clients, with real processes, in one run.

Starts `specd controller` as its own process (embedded Redis, the default pool: 16 unary threads, 256 watchers,
refresh every second). A steady client in a process of its own sends Decide over loopback at --rate calls a second,
paced (a late call starts the next at once, never a burst to catch up), each with a 1 s timeout; its latencies and
failures are cut into windows by wall clock.

  scale          a controller without tokens, taught 50 segments, then --segments: the controller's idle CPU (user +
                 system from /proc, a share of one core, no Decide for --seconds) and the steady client's Decide
                 p50/p99 for --seconds, at three points: 50 segments and no stream (the baseline), --segments and no
                 stream, --segments with --streams WatchDecisions streams open (held by another process, one
                 connection each; the first opens alone, so that the others find its tables built). Goals: idle
                 under 5 % of a core, Decide p99 under 5 ms. Then, the streams still open, the steady client's Decide
                 across the next decay step (every --bucket-seconds, the controller's bucket_seconds: every count's
                 weight moves, so every table is recomputed and sent), from 1 s before it for 1 + --seconds s.
  half-open      (the attacks run on a second controller, with a read and a write token, taught 50 segments)
                 --half-open calls that send HTTP/2 headers and never a message without a token, as many with a
                 wrong token (raw HTTP/2: benchmarks/half_open.py): refused on the event loop, at once
  half-open-mtls (on a third controller, with the same tokens and mutual TLS: tls.client_ca_file; the steady client
                 has a certificate the CA signed) the half-open attack's calls, as many on as many connections, over
                 TLS without a client certificate: refused in gRPC's C core during the handshake
  half-open-mtls-flood  the same, sustained: --flood-threads threads each opening a connection without a client
                 certificate, sending 50 calls' headers, waiting for the refusal and opening the next, back to back
  half-open-read --half-open such calls with the read token: let through, each waiting for its message, no deadline
  health-watch   --health-streams grpc.health.v1.Health/Watch streams, no token (health is open)
  big-reports    ReportRounds at the bounds, back to back from one client: 1,000 aggregates at K 32 (32,000 draft
                 positions of MAX_REPORT_POSITIONS' 32,768), padded to just under MAX_REPORT_BYTES (1 MiB)
  watch-streams  --streams WatchDecisions streams opened together from one host (past max_watchers_per_host, 64,
                 they are refused); at the end one more client's stream, from another host, says whether a worker
                 could still open one
  drafter-sets   one WatchDecisions stream of each of the 31 drafter sets, from one host: each set watched is every
                 table built and kept again (past max_drafter_sets_per_host, 2, they are refused)
  decide-flood   Decide back to back from --flood-threads threads for the learned segments: the control for ...
  segment-flood  ... the same with a made-up segment each call (the segment caps and caches filling)
  busy-neighbour not an attack, the control for big-reports: a process that touches no service keeps one core busy at
                 the report process's niceness (+10), as the report process does with big-reports; no goal

big-reports, watch-streams, drafter-sets, health-watch and the floods connect from another host than the steady
client's (the half-open attacks, refused or held before any handler, from the same): the controller listens on
127.0.0.1 and ::1, the steady client calls over IPv4 and the attacker over IPv6 loopback (the controller's per-host
shares and caps tell them apart; without IPv6 loopback both come from 127.0.0.1).

Each attack: the steady client's p50/p99/slowest call, calls and failures for --seconds before it and for --seconds
from its first byte (the opening burst included), the ratio of the p99s (a stall holds the one call in flight and
the paced client skips the calls it would have made meanwhile: fewer calls and a slow maximum, not a higher p99),
the controller's CPU, threads and RSS in each window, and how long the controller stayed busy once the attacker
stopped (the next attack waits for it, up to 120 s).
Pinned (unless --no-pin, or one CPU): the controller (its Redis and report process with it) and the steady client run
on the first CPU this process may use, the attackers (this process's threads, and the processes it starts) on the
others, so that a ratio is the controller's doing and not two sides taking turns on one core; the busy-neighbour
control, on the attackers' side, then reads about 1.0x. Each attack's row names the CPUs each side ran on.

The goal: no client makes another's request fail or slows it by more than 2x (ratio <= 2, no failure).
A missed goal is printed as MISSED; the exit status is 1 only on a crash.

    python -m benchmarks.controller_scale [--segments 1000] [--streams 256] [--seconds 5] [--rate 100]
        [--bucket-seconds 60] [--no-pin]
        [--only scale,half-open,half-open-mtls,half-open-mtls-flood,half-open-read,health-watch,big-reports,
                watch-streams,drafter-sets,decide-flood,segment-flood,busy-neighbour]
        [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import random
import secrets
import ssl
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: the repository root is not on the path, benchmarks/ is
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.controller_latency import aggregate, decide_request, percentile
from benchmarks.decision_stream import DRAFTERS, cpu_seconds
from benchmarks.faults import DEADLINE_MS, STORE_PREFIX, Controller, _usage, wait_until
from benchmarks.half_open import HalfOpenCalls, ReconnectingCalls, attacker_tls
from controller.decision.policy import DRAFTERS as ALL_DRAFTERS
from controller.serving import validation
from controller.serving.report_process import NICE
from controller.storage.redis_conn import client_for
from controller.storage.store import StoreConfig, TelemetryStore
from specd_api.checks import MAX_AGGREGATES, MAX_REPORT_BYTES, MAX_REPORT_POSITIONS
from specd_api.segments import MAX_SEGMENT_LENGTH
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from tests.daemons import ipv6_loopback
from tests.tls_certs import Pki, make_pki

BASELINE_SEGMENTS = 50
DECIDE_TIMEOUT_S = 1.0  # the steady client's: a failure is an error or an answer later than this
IDLE_GOAL = 0.05  # of one core
P99_GOAL_MS = 5.0
RATIO_GOAL = 2.0
REFRESH_S = 1.0  # the controller's default refresh (and decision tables') period
DECAY_SETTLE_S = 10.0  # after a decay step, for its rebuild and its tables' sending to end (1.5-3 s of CPU)
OPEN_TIMEOUT_S = 300.0  # for the scale phase's streams to have their first message
STREAMS_QUIET = 0.05  # the controller's CPU share with the streams open and nothing else (their heartbeats)
SETTLE_LIMIT_S = 120.0  # after an attack, for the controller's CPU to come back to the steady client's alone
DECIDE = "/specd.v1.Controller/Decide"
REPORT = "/specd.v1.Controller/ReportRounds"
HANDSHAKE_FAILED = b"Handshake failed"  # gRPC core's log line for a refused TLS handshake
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)  # a channel per simulated worker: a connection each
Sample = tuple[float, float, str]  # (wall clock at the call's start, seconds, "" or the failure's status code)
ClientTls = tuple[bytes, bytes, bytes]  # PEM: the CA, the client's key, its certificate (picklable, for a process)


def segment(i: int) -> str:
    return f"tenant-{i}"


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    return () if token is None else (("authorization", f"Bearer {token}"),)


def open_channel(address: str, tls: ClientTls | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """Plaintext, or (``tls``) TLS trusting the CA and presenting the client certificate."""
    if tls is None:
        return grpc.insecure_channel(address, options=options)
    ca, key, cert = tls
    credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
    return grpc.secure_channel(address, credentials, options=options)


@dataclass(frozen=True)
class Settings:
    segments: int = 1000
    streams: int = 256
    seconds: float = 5.0
    rate: float = 100.0  # the steady client's Decide calls per second
    half_open: int = 1000  # per kind of caller
    health_streams: int = 1000
    flood_threads: int = 4
    bucket_seconds: float = 60.0  # the scale controller's (the default's): one decay step each
    pin: bool = True  # the controller and the steady client on one core, the attackers on the others (Cores)
    full_window: bool = False  # every bucket of the scale controller's learning window filled (fill_window)


@dataclass(frozen=True)
class Cores:
    """Where each side runs: the controller (its Redis and report process, started from it, inherit it) and the
    steady client on ``victim``; this process, which runs the attackers' threads and starts their processes (the
    busy-neighbour control's too), on ``attacker``. A ratio is then the controller's doing, not two sides sharing one
    core: the busy-neighbour control reads about 1.0x."""

    victim: frozenset[int]
    attacker: frozenset[int]

    @classmethod
    def split(cls, pin: bool) -> Cores | None:
        """The first CPU this process may use for the victim, the rest for the attacker; None when not pinned (one
        CPU, or ``pin`` off)."""
        cpus = sorted(os.sched_getaffinity(0))
        if not pin or len(cpus) < 2:
            return None
        return cls(frozenset(cpus[:1]), frozenset(cpus[1:]))


def pin_this_process(cpus: frozenset[int]) -> None:
    """Every thread of this process on ``cpus`` (an affinity is per thread; threads and processes started later
    inherit their starter's)."""
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)


@contextlib.contextmanager
def victim_side(cores: Cores | None) -> Iterator[None]:
    """What starts inside runs on the victim's core (its processes keep it); this process returns to the
    attacker's after."""
    if cores is None:
        yield
        return
    pin_this_process(cores.victim)
    try:
        yield
    finally:
        pin_this_process(cores.attacker)


# --- the controller ----------------------------------------------------------------------------------------------


@dataclass
class Target:
    """A running `specd controller`, its tokens (None: none configured), the segments it has learned
    (``segment(0)`` .. ``segment(learned - 1)``) and, with mutual TLS, what a client it lets in presents."""

    controller: Controller
    read_token: str | None = None
    write_token: str | None = None
    learned: int = 0
    client_tls: ClientTls | None = None

    def channel(self, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        return open_channel(self.address, self.client_tls, options)

    def handshakes_failed(self) -> int:
        """The TLS handshakes gRPC's C core has logged as failed (one line each, to the controller's log)."""
        log = self.controller.folder / "controller.log"
        with log.open("rb") as file:
            return sum(HANDSHAKE_FAILED in line for line in file)

    @property
    def address(self) -> str:
        return self.controller.address

    @property
    def attacker_address(self) -> str:
        """Where an attack connects from another host than the steady client's: the controller listens on ::1 too,
        and a call over IPv6 loopback comes from host ::1, the steady client's from 127.0.0.1 (the controller shares
        its work out per client host). Without IPv6 loopback, the steady client's address (one host for both)."""
        return f"[::1]:{self.controller.port}" if ipv6_loopback() else self.address

    @property
    def pid(self) -> int:
        return self.controller.pid

    def alive(self) -> None:
        process = self.controller.process
        if process is None or process.poll() is not None:
            raise RuntimeError(f"the controller exited ({process and process.returncode}); its log is under "
                               f"{self.controller.folder}")  # fmt: skip


def start_target(
    folder: Path, tokens: bool, max_segments: int = 1000, max_watchers: int = 256, bucket_seconds: float = 60.0,
    pki: Pki | None = None, max_watchers_per_host: int | None = None,
) -> Target:  # fmt: skip
    """`specd controller` on its embedded Redis, the default pool, refreshing every second; with ``tokens``, a read
    and a write token (from files); with ``pki``, mutual TLS: its server certificate, client certificates its CA
    signed required."""
    folder.mkdir(parents=True, exist_ok=True)
    read = write = None
    settings = f"max_watchers: {max_watchers}\n" if max_watchers != 256 else ""
    if max_watchers_per_host is not None:
        settings += f"max_watchers_per_host: {max_watchers_per_host}\n"
    if tokens:
        read, write = secrets.token_urlsafe(24), secrets.token_urlsafe(24)
        for name, token in (("read", read), ("write", write)):
            descriptor = os.open(folder / f"{name}.token", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w") as file:
                file.write(token + "\n")
        settings += (f"auth: {{read_token: {{file: {folder / 'read.token'}}}, "
                     f"write_token: {{file: {folder / 'write.token'}}}}}\n")  # fmt: skip
    client_tls = None
    if pki is not None:
        settings += (f"tls: {{cert_file: {pki.server.cert}, key_file: {pki.server.key}, "
                     f"client_ca_file: {pki.ca}}}\n")  # fmt: skip
        client_tls = (pki.ca.read_bytes(), pki.client.key.read_bytes(), pki.client.cert.read_bytes())
    learning = f", max_segments: {max_segments}" if max_segments != 1000 else ""
    learning += f", bucket_seconds: {bucket_seconds:g}" if bucket_seconds != 60.0 else ""
    controller = Controller(folder, "null", refresh_seconds=REFRESH_S, settings=settings, learning=learning,
                            host="localhost")  # fmt: skip
    target = Target(controller, read, write, client_tls=client_tls)
    # the refused handshakes are counted from gRPC core's INFO lines, which `specd` turns off unless asked
    verbosity = os.environ.get("GRPC_VERBOSITY")
    os.environ["GRPC_VERBOSITY"] = "INFO" if pki is not None else (verbosity or "ERROR")
    try:
        controller.start(wait=False)
    finally:
        if verbosity is None:
            del os.environ["GRPC_VERBOSITY"]
        else:
            os.environ["GRPC_VERBOSITY"] = verbosity
    try:
        with target.channel() as channel:
            pb_grpc.ControllerStub(channel).GetPolicy(
                pb.GetPolicyRequest(), metadata=bearer(read), timeout=60, wait_for_ready=True
            )
    except BaseException:
        controller.stop()
        raise
    return target


def teach(target: Target, count: int) -> None:
    """Two aggregates of 50 rounds each (past the default prior_strength: every segment gets a decision table) for
    the segments from ``target.learned`` to ``count``, in reports of 500; returns once Decide sees the last one."""
    rng = random.Random(count)
    aggregates = [aggregate(segment(i), rng) for i in range(target.learned, count) for _ in range(2)]
    with target.channel() as channel:
        stub = pb_grpc.ControllerStub(channel)
        for n in range(0, len(aggregates), 500):
            request = pb.ReportRoundsRequest(report_id=f"teach-{count}-{n}", aggregates=aggregates[n : n + 500])
            stub.ReportRounds(request, metadata=bearer(target.write_token), timeout=60)
    last = segment(count - 1)
    wait_until(lambda: rounds_of(target, last) >= 100, 60, f"the controller to learn {count} segments", every=0.2)
    target.learned = count


def fill_window(target: Target, settings: Settings, segments: range) -> float:
    """Two aggregates for each of ``segments`` in every bucket of the learning window before the current one, in
    the controller's Redis; returns the seconds it took. A report over gRPC lands in the current bucket, so these
    are stored at each bucket's time by a store of the controller's settings under a prefix of their own, then their
    bucket hashes renamed into the controller's: it finds a segment (and reads it over its whole window) once a
    report names it, which must come after (``teach``). A segment it had read already would not see them (a write
    dated a bucket before its last read is another replica's clock skew)."""
    started = time.perf_counter()
    scratch = f"{STORE_PREFIX}-window"
    config = StoreConfig(prefix=scratch, bucket_seconds=settings.bucket_seconds,
                         max_segments=max(settings.segments, 1000))  # fmt: skip
    client = client_for(embedded_redis_url(target.pid), 10.0)
    current = math.floor(time.time() / settings.bucket_seconds)
    rng = random.Random(segments.start)
    for b in range(current - config.window_buckets + 1, current):
        at = (b + 0.5) * settings.bucket_seconds
        store = TelemetryStore(client, config, lambda at=at: at)  # type: ignore[misc]
        aggregates = [aggregate(segment(i), rng) for i in segments for _ in range(2)]
        for n in range(0, len(aggregates), MAX_AGGREGATES):
            request = pb.ReportRoundsRequest(
                report_id=f"window-{segments.start}-{b}-{n}", aggregates=aggregates[n : n + MAX_AGGREGATES]
            )
            store.ingest(*validation.report(request))
    renamed = client.pipeline(transaction=False)
    for key in client.scan_iter(match=f"{scratch}:*", count=1000):
        if ":seg:" in key:
            renamed.rename(key, STORE_PREFIX + key.removeprefix(scratch))
        else:
            renamed.delete(key)
    renamed.execute()
    client.close()
    return time.perf_counter() - started


def rounds_of(target: Target, name: str) -> float:
    """The rounds the controller counts for segment ``name``."""
    with target.channel() as channel:
        stats = pb_grpc.ControllerStub(channel).GetSegmentStats(
            pb.GetSegmentStatsRequest(segment=name), metadata=bearer(target.read_token), timeout=10
        )
    return sum(k.rounds for d in stats.drafters for k in d.by_k)


def embedded_redis_url(controller: int) -> str:
    """The URL of the embedded Redis the controller ``controller`` (a pid) started: its child's Unix socket."""
    children = [
        c for task in Path(f"/proc/{controller}/task").iterdir() for c in (task / "children").read_text().split()
    ]
    for child in children:  # Valkey sets its process title: "valkey-server unixsocket:<path>"
        words = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").split()
        for word in words:
            if word.startswith(b"unixsocket:"):
                return "unix://" + word.removeprefix(b"unixsocket:").decode()
    raise RuntimeError(f"controller {controller} has no embedded Redis child")


# --- what is measured: windows of wall time, the steady client's samples -----------------------------------------


class Window:
    """A stretch of wall time on the controller process: its CPU (a share of one core) over it, and its threads and
    RSS at the end."""

    def __init__(self, pid: int) -> None:
        self.pid, self.start = pid, time.time()
        self._clock, self._cpu = time.perf_counter(), cpu_seconds(pid)
        self.end = self.cpu_share = self.rss_mib = math.nan
        self.threads = 0

    def close_after(self, seconds: float) -> Window:
        time.sleep(max(self._clock + seconds - time.perf_counter(), 0.0))
        wall = time.perf_counter() - self._clock
        self.cpu_share = (cpu_seconds(self.pid) - self._cpu) / wall
        self.end = time.time()
        self.threads = len(os.listdir(f"/proc/{self.pid}/task"))
        self.rss_mib = _usage(self.pid)[0] / 2**20
        return self


@dataclass
class Latency:
    """The steady client's calls that started in a window."""

    calls: int
    failures: int
    p50_ms: float
    p99_ms: float
    max_ms: float  # the slowest answered call: a stall holds one call of the paced client, which the p99 can miss
    over_deadline: int  # answered later than the worker's decide deadline (5 ms): a fallback in a worker
    codes: dict[str, int]  # the failures, by status code

    @classmethod
    def of(cls, samples: Sequence[Sample], window: Window) -> Latency:
        mine = [s for s in samples if window.start <= s[0] < window.end]
        answered = [seconds for _, seconds, code in mine if not code]
        return cls(
            calls=len(mine), failures=len(mine) - len(answered),
            p50_ms=1000 * percentile(answered, 0.5) if answered else math.nan,
            p99_ms=1000 * percentile(answered, 0.99) if answered else math.nan,
            max_ms=1000 * max(answered) if answered else math.nan,
            over_deadline=sum(seconds > DEADLINE_MS / 1000 for _, seconds, _ in mine),
            codes=dict(Counter(code for _, _, code in mine if code)),
        )  # fmt: skip


def probe(
    address: str, token: str | None, rate: float, segments: Any, go: Any, ready: Any, stop: Any, out: Any,
    tls: ClientTls | None = None,
) -> None:  # fmt: skip
    """The steady client (a process of its own): Decide at ``rate`` a second while ``go`` is set, for a segment
    drawn from the first ``segments.value`` learned, until ``stop``; puts its samples on ``out``. With ``tls``, over
    mutual TLS."""
    rng = random.Random(7)
    requests = [decide_request(rng) for _ in range(16)]
    metadata = bearer(token)
    samples: list[Sample] = []
    with open_channel(address, tls) as channel:
        decide = pb_grpc.ControllerStub(channel).Decide
        decide(requests[0], metadata=metadata, timeout=60, wait_for_ready=True)  # connected before the clock
        ready.set()
        period, due = 1.0 / rate, time.perf_counter()
        while not stop.is_set():
            if not go.is_set():
                go.wait(0.1)
                due = time.perf_counter()
                continue
            time.sleep(max(due - time.perf_counter(), 0.0))
            request = requests[len(samples) % len(requests)]
            request.segment = segment(rng.randrange(segments.value))
            wall, start = time.time(), time.perf_counter()
            try:
                decide(request, metadata=metadata, timeout=DECIDE_TIMEOUT_S)
                code = ""
            except grpc.RpcError as e:
                code = e.code().name
            samples.append((wall, time.perf_counter() - start, code))
            due = max(due + period, time.perf_counter() - period)  # late: the next at once, no burst to catch up
    out.put(samples)


class Prober:
    """The steady client's process: ``resume`` / ``pause`` its calls, ``learned`` sets the segments it draws from;
    its samples are in ``samples`` once the ``with`` block ends."""

    def __init__(self, target: Target, rate: float, cores: Cores | None) -> None:
        self._cores = cores  # the steady client runs on the victim's core
        context = multiprocessing.get_context("spawn")
        self._segments = context.Value("i", max(target.learned, 1))
        self._go, self._ready, self._stop = context.Event(), context.Event(), context.Event()
        self._out = context.Queue()
        self._process = context.Process(
            target=probe, name="steady-client", daemon=True,
            args=(target.address, target.read_token, rate, self._segments, self._go, self._ready, self._stop,
                  self._out, target.client_tls),
        )  # fmt: skip
        self.samples: list[Sample] = []

    def __enter__(self) -> Prober:
        with victim_side(self._cores):
            self._process.start()
        if not self._ready.wait(90):
            self._process.terminate()
            raise RuntimeError("the steady client did not connect within 90 s")
        return self

    @property
    def pid(self) -> int:
        assert self._process.pid is not None, "started"
        return self._process.pid

    def resume(self) -> None:
        self._go.set()

    def pause(self) -> None:
        self._go.clear()

    def learned(self, count: int) -> None:
        self._segments.value = count

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._go.set()
        try:
            self.samples = self._out.get(timeout=30)
        finally:
            self._process.join(10)
            if self._process.is_alive():
                self._process.terminate()


# --- WatchDecisions streams held by another process --------------------------------------------------------------


def hold_streams(
    address: str, count: int, token: str | None, first_alone: bool, go: Any, ready: Any, stop: Any, out: Any,
    drafter_sets: Sequence[Sequence[str]] = (DRAFTERS,),
) -> None:  # fmt: skip
    """Once ``go`` is set, ``count`` WatchDecisions streams (a connection each; stream i watches ``drafter_sets``'
    i-th, in turn) read to the end, all at once or, with ``first_alone``, the others once the first has its first
    message; ``ready`` is set when every one has its first message or has failed. At ``stop``, they are cancelled and
    what happened goes to ``out``."""
    out.put(asyncio.run(_hold(address, count, token, first_alone, go, ready, stop, drafter_sets)))


async def _hold(
    address: str, count: int, token: str | None, first_alone: bool, go: Any, ready: Any, stop: Any,
    drafter_sets: Sequence[Sequence[str]],
) -> dict[str, Any]:  # fmt: skip
    await asyncio.to_thread(go.wait)
    started = time.perf_counter()
    state: dict[str, Any] = {"opened": 0, "failed": Counter(), "ended": 0, "messages": 0, "full_bytes": 0,
                             "full_segments": 0, "later_bytes": 0, "later_segments": 0,
                             "seconds_to_first": math.nan, "seconds_to_open": math.nan}  # fmt: skip
    channels = [grpc.aio.insecure_channel(address, options=OWN_CONNECTION) for _ in range(count)]

    def settled() -> None:
        if state["opened"] + sum(state["failed"].values()) == count and not ready.is_set():
            state["seconds_to_open"] = time.perf_counter() - started
            ready.set()

    async def watch(i: int, channel: grpc.aio.Channel) -> None:
        request = pb.WatchDecisionsRequest(worker_id=f"scale-{i}", drafters=drafter_sets[i % len(drafter_sets)])
        call = pb_grpc.ControllerStub(channel).WatchDecisions(request, metadata=bearer(token))
        first = True
        try:
            async for tables in call:
                state["messages"] += 1
                if first:
                    first = False
                    state["opened"] += 1
                    state["full_bytes"] = max(state["full_bytes"], tables.ByteSize())
                    state["full_segments"] = max(state["full_segments"], len(tables.segments))
                    settled()
                else:
                    state["later_bytes"] += tables.ByteSize()
                    state["later_segments"] += len(tables.segments)
            state["ended"] += 1  # the server ended it
        except grpc.aio.AioRpcError as e:
            if first:
                state["failed"][e.code().name] += 1
                settled()
            else:
                state["ended"] += 1

    tasks = [asyncio.create_task(watch(0, channels[0]))]
    while first_alone and not tasks[0].done() and state["opened"] + sum(state["failed"].values()) == 0:
        await asyncio.sleep(0.01)
    state["seconds_to_first"] = time.perf_counter() - started
    tasks += [asyncio.create_task(watch(i, channel)) for i, channel in enumerate(channels[1:], 1)]
    await asyncio.to_thread(stop.wait)
    held = time.perf_counter() - started
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close()
    failed = dict(state.pop("failed"))
    later = max(state["messages"] - state["opened"], 1)  # the messages after each stream's first
    return {**state, "streams": count, "refused": failed, "held_seconds": held,
            "messages_per_stream_per_second": state["messages"] / max(state["opened"], 1) / held,
            "later_mean_bytes": state["later_bytes"] / later,
            "later_mean_segments": state["later_segments"] / later}  # fmt: skip


class StreamHolder:
    """``spawn`` the holding process (it imports and waits), ``open`` the streams, ``wait_ready``, ``close`` (what
    happened to them). With ``first_alone``, the first stream opens alone: the tables it builds serve the others."""

    def __init__(
        self, target: Target, count: int, first_alone: bool = False, address: str | None = None,
        drafter_sets: Sequence[Sequence[str]] = (DRAFTERS,),
    ) -> None:  # fmt: skip
        context = multiprocessing.get_context("spawn")
        self._go, self._ready, self._stop = context.Event(), context.Event(), context.Event()
        self._out = context.Queue()
        self._process = context.Process(
            target=hold_streams, name="watch-streams", daemon=True,
            args=(address or target.address, count, target.read_token, first_alone, self._go, self._ready, self._stop,
                  self._out, [list(d) for d in drafter_sets]),
        )  # fmt: skip

    def spawn(self) -> StreamHolder:
        self._process.start()
        return self

    def open(self) -> None:
        self._go.set()

    def wait_ready(self, timeout: float) -> bool:
        return self._ready.wait(timeout)

    def close(self) -> dict[str, Any]:
        self._go.set()
        self._stop.set()
        try:
            return dict(self._out.get(timeout=60))
        finally:
            self._process.join(10)
            if self._process.is_alive():
                self._process.terminate()


# --- scale ------------------------------------------------------------------------------------------------------


@dataclass
class Point:
    segments: int
    streams: int
    idle: Window
    deciding: Window

    def result(self, samples: Sequence[Sample]) -> dict[str, Any]:
        decide = Latency.of(samples, self.deciding)
        return {"segments": self.segments, "streams": self.streams, "idle_cpu_share": self.idle.cpu_share,
                "decide_p50_ms": decide.p50_ms, "decide_p99_ms": decide.p99_ms, "decide_calls": decide.calls,
                "decide_failures": decide.failures, "decide_over_deadline": decide.over_deadline,
                "cpu_share_deciding": self.deciding.cpu_share, "threads": self.deciding.threads,
                "rss_mib": self.deciding.rss_mib}  # fmt: skip


def measure(target: Target, prober: Prober, streams: int, seconds: float) -> Point:
    prober.pause()
    idle = Window(target.pid).close_after(seconds)
    prober.resume()
    deciding = Window(target.pid).close_after(seconds)
    prober.pause()
    target.alive()
    return Point(target.learned, streams, idle, deciding)


def clear_of_a_decay_step(settings: Settings, needed: float) -> None:
    """Wait, if the next decay step would fall in the next ``needed`` seconds, until DECAY_SETTLE_S after it: the
    steady points measure the controller between steps (the step has its own row, and the bucket-period average)."""
    step = settings.bucket_seconds
    boundary = math.ceil(time.time() / step) * step
    if boundary - time.time() < needed:
        time.sleep(max(boundary + DECAY_SETTLE_S - time.time(), 0.0))


def across_a_decay_step(target: Target, prober: Prober, settings: Settings) -> Window:
    """The steady client's calls from 1 s before the next decay step (a multiple of bucket_seconds in unix time:
    the first refresh after it finds every count's weight moved) for 1 + ``settings.seconds`` s."""
    step = settings.bucket_seconds
    boundary = math.ceil((time.time() + 1.5) / step) * step
    time.sleep(max(boundary - 1.0 - time.time(), 0.0))
    prober.resume()
    window = Window(target.pid).close_after(1.0 + settings.seconds)
    prober.pause()
    target.alive()
    return window


def scale(root: Path, settings: Settings, cores: Cores | None) -> dict[str, Any]:
    """The three points (50 segments, no stream; all segments, no stream; all segments and the streams), then the
    steady client across a decay step, the streams open."""
    # the streams are a fleet's, all from this one host: max_watchers_per_host lets them all in
    watchers = max(settings.streams, 256)
    with victim_side(cores):
        target = start_target(root / "scale", tokens=False, max_segments=max(settings.segments, 1000),
                              max_watchers=watchers, bucket_seconds=settings.bucket_seconds,
                              max_watchers_per_host=watchers)  # fmt: skip
    try:
        baseline = min(BASELINE_SEGMENTS, settings.segments)
        fill_s = fill_window(target, settings, range(baseline)) if settings.full_window else 0.0
        teach(target, baseline)
        with Prober(target, settings.rate, cores) as prober:
            points = [measure(target, prober, 0, settings.seconds)]
            if settings.full_window:
                fill_s += fill_window(target, settings, range(baseline, settings.segments))
            teach(target, settings.segments)
            settle(target, 0.02)  # every segment read over its window
            window_rounds = [rounds_of(target, segment(i)) for i in (0, settings.segments - 1)]
            prober.learned(settings.segments)
            points.append(measure(target, prober, 0, settings.seconds))
            holder = StreamHolder(target, settings.streams, first_alone=True).spawn()
            try:
                holder.open()
                all_open = holder.wait_ready(OPEN_TIMEOUT_S)  # if not, measured anyway, and reported
                time.sleep(REFRESH_S)  # past the opening: the first refresh after it
                # the opening's work done (the tables whose data moved during the first build are built again)
                streams_settle_s = settle(target, STREAMS_QUIET)
                clear_of_a_decay_step(settings, 2 * settings.seconds + 1.0)
                points.append(measure(target, prober, settings.streams, settings.seconds))
                step = across_a_decay_step(target, prober, settings)
            finally:
                streams = holder.close()
            streams["all_open_within_timeout"] = all_open
            streams["settle_s"] = streams_settle_s
        target.alive()
    finally:
        target.controller.stop()
    rows = [p.result(prober.samples) for p in points]
    at_scale = rows[-1]
    decide = Latency.of(prober.samples, step)
    at_step = {"decide_p50_ms": decide.p50_ms, "decide_p99_ms": decide.p99_ms, "decide_calls": decide.calls,
               "decide_failures": decide.failures, "decide_over_deadline": decide.over_deadline,
               "cpu_share": step.cpu_share, "seconds": step.end - step.start}  # fmt: skip
    # the step's CPU beyond the same window's without one (deciding, streams open), spread over its bucket period
    extra = max(step.cpu_share - at_scale["cpu_share_deciding"], 0.0) * (step.end - step.start)
    at_step["extra_cpu_seconds"] = extra
    return {"idle_cpu_share": at_scale["idle_cpu_share"], "decide_p99_ms": at_scale["decide_p99_ms"],
            "idle_cpu_share_with_steps": at_scale["idle_cpu_share"] + extra / settings.bucket_seconds,
            "baseline_decide_p99_ms": rows[0]["decide_p99_ms"], "points": rows, "streams": streams,
            "decay_step": at_step, "full_window": settings.full_window,
            "window_fill_seconds": fill_s, "rounds_first_and_last_segment": window_rounds}  # fmt: skip


# --- attacks ----------------------------------------------------------------------------------------------------


class Attack:
    """One hostile client: ``prepare`` (before the clock: processes spawned, messages built), ``start`` (its first
    byte), ``stop`` (it ends; returns what it did)."""

    what = ""

    def prepare(self) -> None:
        return None

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> dict[str, Any]:
        raise NotImplementedError


class HalfOpen(Attack):
    """Calls that send their headers and never a message: ``kinds`` as (method, token or None); over TLS with
    ``tls`` (then also the connections refused in the handshake, by reason)."""

    def __init__(
        self, target: Target, count: int, kinds: Sequence[tuple[str, str | None]], what: str,
        tls: ssl.SSLContext | None = None,
    ) -> None:  # fmt: skip
        self.target, self.count, self.kinds, self.what, self.tls = target, count, kinds, what, tls
        self._calls: list[HalfOpenCalls] = []
        self._logged = 0

    def start(self) -> None:
        if self.tls is not None:
            self._logged = self.target.handshakes_failed()
        for method, token in self.kinds:
            calls = HalfOpenCalls(self.target.address, method, self.count, token=token, tls=self.tls)
            self._calls.append(calls.open())

    def stop(self) -> dict[str, Any]:
        ended = sum(calls.ended_by_server for calls in self._calls)
        refused: Counter[str] = Counter()
        for calls in self._calls:
            refused.update(calls.refused)
            calls.close()
        did = {"calls": self.count * len(self.kinds), "ended_by_server": ended}
        if self.tls is not None:
            did |= {"connections": sum(calls.connections for calls in self._calls),
                    "refused_in_handshake": sum(refused.values()), "refusals": dict(refused),
                    "server_logged_handshake_failed": self.target.handshakes_failed() - self._logged}  # fmt: skip
        return did


class HandshakeFlood(Attack):
    """``threads`` threads opening connections back to back (TLS without a client certificate), each sending 50
    calls' headers and waiting for the server to break it off: half of them call Decide with no token, half
    ReportRounds with a wrong one."""

    what = "connections back to back over TLS without a client certificate, 50 calls' headers each"

    def __init__(self, target: Target, threads: int) -> None:
        self.target, self.threads = target, threads
        self._floods: list[ReconnectingCalls] = []
        self._logged = 0

    def start(self) -> None:
        self._logged = self.target.handshakes_failed()
        kinds = [(DECIDE, None), (REPORT, "wrong-token")]
        for i in range(self.threads):
            method, token = kinds[i % 2]
            self._floods.append(ReconnectingCalls(self.target.address, method, 1, token=token,
                                                  tls=attacker_tls()).open())  # fmt: skip

    def stop(self) -> dict[str, Any]:
        done = [flood.close() for flood in self._floods]
        refused: Counter[str] = Counter()
        for d in done:
            refused.update(d["refused"])
        connections = sum(d["connections"] for d in done)
        return {"threads": self.threads, "connections": connections, "calls": 50 * connections,
                "connections_per_second": sum(d["connections_per_second"] for d in done),
                "refused_in_handshake": sum(refused.values()), "refusals": dict(refused),
                "let_through": sum(d["let_through"] for d in done),
                "server_logged_handshake_failed": self.target.handshakes_failed() - self._logged}  # fmt: skip


class HealthWatch(Attack):
    what = "unauthenticated grpc.health.v1.Health/Watch streams"

    def __init__(self, target: Target, count: int) -> None:
        self.target, self.count = target, count
        self._channels: list[grpc.Channel] = []
        self._calls: list[Any] = []
        self._answered = 0
        self._refused: Counter[str] = Counter()  # past the controller's bounds (MAX_HEALTH_STREAMS_PER_HOST)
        self._reader = threading.Thread(target=self._read, name="health-watch", daemon=True)

    def start(self) -> None:
        self._channels = [grpc.insecure_channel(self.target.attacker_address, options=OWN_CONNECTION)
                          for _ in range(math.ceil(self.count / 100))]  # fmt: skip
        request = health_pb2.HealthCheckRequest(service="")
        for i in range(self.count):
            self._calls.append(health_pb2_grpc.HealthStub(self._channels[i // 100]).Watch(request))
        self._reader.start()

    def _read(self) -> None:
        for call in self._calls:
            try:
                next(call)
                self._answered += 1
            except grpc.RpcError as e:
                self._refused[e.code().name] += 1  # type: ignore[attr-defined]
            except StopIteration:
                pass

    def stop(self) -> dict[str, Any]:
        answered = self._answered
        for call in self._calls:
            call.cancel()
        self._reader.join(10)
        for channel in self._channels:
            channel.close()
        return {"streams": self.count, "answered": answered, "refused": dict(self._refused)}


def report_at_the_bounds(prefix: str) -> pb.ReportRoundsRequest:
    """MAX_AGGREGATES aggregates at K 32 (under MAX_REPORT_POSITIONS), their 16 segments' names padded so that the
    report is just under MAX_REPORT_BYTES. Each aggregate is valid: every position and per-n table filled with
    numbers of 4 or 5 bytes."""
    k = MAX_REPORT_POSITIONS // MAX_AGGREGATES
    by_drafted = [30_000_000] * (k + 1)  # rounds that drafted n = 0..k tokens; 1e9 rounds at most in all
    proposed = [sum(by_drafted[i + 1 :]) for i in range(k)]
    verified: list[int] = []
    accepted: list[int] = []
    for i in range(k):
        verified.append(proposed[0] if i == 0 else min(accepted[-1], proposed[i]))
        accepted.append(verified[-1] * 7 // 10)
    seconds = [0.012 * r for r in by_drafted]
    rounds, drafted = sum(by_drafted), sum(proposed)

    def one(name: str) -> pb.RoundsAggregate:
        return pb.RoundsAggregate(
            segment=name, drafter="draft", k=k, rounds=rounds, num_drafted=drafted, num_accepted=sum(accepted),
            proposed_per_position=proposed, verified_per_position=verified, accepted_per_position=accepted,
            tokens_emitted=sum(accepted) + rounds, draft_seconds=0.001 * drafted, verify_seconds=sum(seconds),
            rounds_by_drafted=by_drafted, verify_seconds_by_drafted=seconds, batch_size=1, temperature=0.0,
            prompt_tokens=200, self_repetition=0.2,
        )  # fmt: skip

    def report(pad: int) -> pb.ReportRoundsRequest:
        aggregates = [one(f"{prefix}-{i % 16:02d}" + "x" * pad) for i in range(MAX_AGGREGATES)]
        return pb.ReportRoundsRequest(report_id=prefix.ljust(128, "0"), worker_id="w" * 128, aggregates=aggregates)

    room = MAX_REPORT_BYTES - 4096 - report(0).ByteSize()  # 4 KiB to spare: the report id changes per call
    padded = report(min(room // MAX_AGGREGATES, MAX_SEGMENT_LENGTH - len(prefix) - 3))
    assert padded.ByteSize() <= MAX_REPORT_BYTES - 1024, padded.ByteSize()
    return padded


class Loop(Attack):
    """``threads`` threads calling ``once`` back to back (each with its own channel) until stopped."""

    def __init__(self, target: Target, threads: int) -> None:
        self.target, self.threads = target, threads
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pool: list[threading.Thread] = []
        self.calls = 0
        self.codes: Counter[str] = Counter()
        self.latencies: list[float] = []
        self._started = 0.0

    def once(self, stub: pb_grpc.ControllerStub, n: int) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._started = time.perf_counter()
        self._pool = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)]
        for thread in self._pool:
            thread.start()

    def _run(self, i: int) -> None:
        with grpc.insecure_channel(self.target.attacker_address, options=OWN_CONNECTION) as channel:
            stub = pb_grpc.ControllerStub(channel)
            n = 0
            while not self._stop.is_set():
                start, code = time.perf_counter(), ""
                try:
                    self.once(stub, i * 10**9 + n)
                except grpc.RpcError as e:
                    code = e.code().name
                with self._lock:
                    self.calls += 1
                    self.latencies.append(time.perf_counter() - start)
                    if code:
                        self.codes[code] += 1
                n += 1

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        for thread in self._pool:
            thread.join(60)
        seconds = time.perf_counter() - self._started
        return {"calls": self.calls, "calls_per_second": self.calls / seconds, "refused": dict(self.codes),
                "p50_ms": 1000 * percentile(self.latencies, 0.5) if self.latencies else math.nan}  # fmt: skip


class BigReports(Loop):
    what = "ReportRounds at the bounds, back to back (1,000 aggregates, 32,000 positions, ~1 MiB)"

    def prepare(self) -> None:
        self.report = report_at_the_bounds("bulk")
        self.bytes = self.report.ByteSize()

    def once(self, stub: pb_grpc.ControllerStub, n: int) -> None:
        report = pb.ReportRoundsRequest()
        report.CopyFrom(self.report)
        report.report_id = f"bulk-{n}"
        stub.ReportRounds(report, metadata=bearer(self.target.write_token), timeout=60)

    def stop(self) -> dict[str, Any]:
        return {**super().stop(), "report_bytes": self.bytes, "aggregates": len(self.report.aggregates),
                "positions": sum(a.k for a in self.report.aggregates)}  # fmt: skip


def spin(nice: int, stop: Any) -> None:
    """Keep one core busy at ``nice`` until ``stop`` is set (``BusyNeighbour``'s process)."""
    os.nice(nice)
    while not stop.is_set():
        for _ in range(10_000):
            pass


class BusyNeighbour(Attack):
    """Not an attack: the control for big-reports. A process that touches no service keeps one core busy at the
    report process's niceness (serving/report_process.py NICE), as the report process does with reports at the
    bounds back to back; the steady client's ratio beside it is what these 2 cores give whatever the controller
    does."""

    what = "control: one core kept busy at nice +10 by a process that touches no service"

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._process = context.Process(target=spin, args=(NICE, self._stop), name="busy-neighbour", daemon=True)

    def start(self) -> None:
        self._process.start()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._process.join(10)
        return {"nice": NICE}


class DecideFlood(Loop):
    """Decide back to back for the learned segments, or (``made_up``) for a segment never seen each time."""

    def __init__(self, target: Target, threads: int, made_up: bool) -> None:
        super().__init__(target, threads)
        self.made_up = made_up
        self.what = f"Decide back to back, {'a made-up segment each' if made_up else 'learned segments (control)'}"

    def once(self, stub: pb_grpc.ControllerStub, n: int) -> None:
        name = f"made-up-{n:x}" if self.made_up else segment(n % self.target.learned)
        request = pb.DecideRequest(segment=name, batch_size=1, drafters=DRAFTERS, max_new_tokens=128)
        stub.Decide(request, metadata=bearer(self.target.read_token), timeout=10)


class WatchStreams(Attack):
    what = "WatchDecisions streams opened together"

    def __init__(self, target: Target, count: int, drafter_sets: Sequence[Sequence[str]] = (DRAFTERS,)) -> None:
        self.target, self.count = target, count
        self._holder = StreamHolder(target, count, address=target.attacker_address, drafter_sets=drafter_sets)

    def prepare(self) -> None:
        self._holder.spawn()

    def start(self) -> None:
        self._holder.open()

    def stop(self) -> dict[str, Any]:
        another = "OK"  # one more client's stream, beside them
        with grpc.insecure_channel(self.target.address) as channel:
            request = pb.WatchDecisionsRequest(worker_id="victim", drafters=DRAFTERS)
            call = pb_grpc.ControllerStub(channel).WatchDecisions(request, metadata=bearer(self.target.read_token),
                                                                  timeout=10)  # fmt: skip
            try:
                next(call)
            except grpc.RpcError as e:
                another = e.code().name
            call.cancel()
        held = self._holder.close()
        return {**{k: held[k] for k in ("streams", "opened", "refused", "seconds_to_first", "seconds_to_open",
                                         "full_bytes")},
                "another_client_stream": another}  # fmt: skip


class DrafterSets(WatchStreams):
    what = "a WatchDecisions stream of each drafter set from one host"

    def __init__(self, target: Target) -> None:
        every = [list(c) for n in range(1, len(ALL_DRAFTERS) + 1) for c in itertools.combinations(ALL_DRAFTERS, n)]
        super().__init__(target, len(every), every)


def refused_half_open(target: Target, settings: Settings) -> Attack:
    kinds = [(DECIDE, None), (REPORT, "wrong-token")]
    return HalfOpen(target, settings.half_open, kinds, "calls with headers and no message: no token, a wrong token")


def refused_in_the_handshake(target: Target, settings: Settings) -> Attack:
    kinds = [(DECIDE, None), (REPORT, "wrong-token")]
    return HalfOpen(target, settings.half_open, kinds, "the same calls over TLS without a client certificate, to a "
                    "mutual-TLS port", tls=attacker_tls())  # fmt: skip


def waiting_half_open(target: Target, settings: Settings) -> Attack:
    kinds = [(DECIDE, target.read_token)]
    return HalfOpen(target, settings.half_open, kinds, "calls with headers and no message, with the read token")


ATTACKS: dict[str, Callable[[Target, Settings], Attack]] = {
    "half-open": refused_half_open,
    "half-open-mtls": refused_in_the_handshake,
    "half-open-mtls-flood": lambda t, s: HandshakeFlood(t, s.flood_threads),
    "half-open-read": waiting_half_open,
    "health-watch": lambda t, s: HealthWatch(t, s.health_streams),
    "big-reports": lambda t, s: BigReports(t, threads=1),
    "watch-streams": lambda t, s: WatchStreams(t, s.streams),
    "drafter-sets": lambda t, s: DrafterSets(t),
    "decide-flood": lambda t, s: DecideFlood(t, s.flood_threads, made_up=False),
    "segment-flood": lambda t, s: DecideFlood(t, s.flood_threads, made_up=True),
    "busy-neighbour": lambda t, s: BusyNeighbour(),
}
CONTROLS = frozenset({"busy-neighbour"})  # rows that are not attacks: no goal, printed as a control
MUTUAL_TLS = frozenset({"half-open-mtls", "half-open-mtls-flood"})  # the attacks on the mutual-TLS controller


@dataclass
class Run:
    name: str
    what: str
    before: Window
    during: Window
    did: dict[str, Any] = field(default_factory=dict)
    busy_after_s: float = math.nan  # after the attack stopped, until the controller's CPU came back

    def result(self, samples: Sequence[Sample]) -> dict[str, Any]:
        before, during = Latency.of(samples, self.before), Latency.of(samples, self.during)
        ratio = during.p99_ms / before.p99_ms if before.p99_ms > 0 else math.nan
        return {"what": self.what, "p50_before_ms": before.p50_ms, "p99_before_ms": before.p99_ms,
                "p50_during_ms": during.p50_ms, "p99_during_ms": during.p99_ms, "ratio": ratio,
                "max_before_ms": before.max_ms, "max_during_ms": during.max_ms,
                "calls_before": before.calls, "calls_during": during.calls, "failures_before": before.failures,
                "failures_during": during.failures, "failure_codes_during": during.codes,
                "over_deadline_before": before.over_deadline, "over_deadline_during": during.over_deadline,
                "cpu_share_before": self.before.cpu_share, "cpu_share_during": self.during.cpu_share,
                "threads_before": self.before.threads, "threads_during": self.during.threads,
                "rss_mib_before": self.before.rss_mib, "rss_mib_during": self.during.rss_mib,
                "busy_after_s": self.busy_after_s, "attacker": self.did}  # fmt: skip


def attack(name: str, target: Target, settings: Settings) -> Run:
    """``seconds`` of the steady client alone, then ``seconds`` from the attack's first byte."""
    hostile = ATTACKS[name](target, settings)
    hostile.prepare()
    before = Window(target.pid).close_after(settings.seconds)
    during = Window(target.pid)
    hostile.start()
    try:
        during.close_after(settings.seconds)
    finally:
        did = hostile.stop()
    return Run(name, hostile.what, before, during, did)


SETTLE_WINDOW_S = 1.5 * REFRESH_S  # a quiet window holds a refresh's start: the gap between two refreshes is not quiet


def settle(target: Target, quiet: float) -> float:
    """Seconds until the controller's CPU over SETTLE_WINDOW_S is back near ``quiet`` (at most SETTLE_LIMIT_S): what
    an attack left behind (work queued, streams still building their tables) ends before the next one's clock. The
    window is longer than the refresh period, or the second of two long refreshes (a report landing during the
    first) would start after a quiet gap, inside the next measurement."""
    start = time.perf_counter()
    while time.perf_counter() - start < SETTLE_LIMIT_S:
        if Window(target.pid).close_after(SETTLE_WINDOW_S).cpu_share <= 1.5 * quiet + 0.05:
            break
    return time.perf_counter() - start


def attacks(root: Path, names: Sequence[str], settings: Settings, cores: Cores | None) -> dict[str, dict[str, Any]]:
    """The attacks in ``names`` on a controller with tokens, those in MUTUAL_TLS on one that also has mutual TLS
    (started once the first is stopped); the results in the order of ``names``."""
    results: dict[str, dict[str, Any]] = {}
    plain = [name for name in names if name not in MUTUAL_TLS]
    mutual = [name for name in names if name in MUTUAL_TLS]
    if plain:
        with victim_side(cores):
            target = start_target(root / "attacks", tokens=True)
        results |= attacks_on(target, plain, settings, cores)
    if mutual:
        pki = make_pki(root / "attacks-mtls" / "pki")
        with victim_side(cores):
            target = start_target(root / "attacks-mtls", tokens=True, pki=pki)
        results |= attacks_on(target, mutual, settings, cores)
    return {name: results[name] for name in names}


def attacks_on(
    target: Target, names: Sequence[str], settings: Settings, cores: Cores | None
) -> dict[str, dict[str, Any]]:
    try:
        teach(target, min(BASELINE_SEGMENTS, settings.segments))
        with Prober(target, settings.rate, cores) as prober:
            prober.resume()
            where = {"controller_cpus": sorted(os.sched_getaffinity(target.pid)),
                     "steady_client_cpus": sorted(os.sched_getaffinity(prober.pid)),
                     "attacker_cpus": sorted(os.sched_getaffinity(0))}  # fmt: skip
            quiet = Window(target.pid).close_after(settings.seconds).cpu_share  # the steady client alone
            runs = []
            for name in names:
                print(f"--- {name}", flush=True)
                runs.append(attack(name, target, settings))
                runs[-1].busy_after_s = settle(target, quiet)
                target.alive()
    finally:
        target.controller.stop()
    return {run.name: run.result(prober.samples) | where for run in runs}


# --- the report -------------------------------------------------------------------------------------------------


def missed(figures: dict[str, Any]) -> list[str]:
    """Each goal the figures miss, in words."""
    out = []
    if "scale" in figures:
        s = figures["scale"]
        if not s["idle_cpu_share"] < IDLE_GOAL:
            out.append(f"scale: idle CPU {s['idle_cpu_share']:.1%} of a core (goal < {IDLE_GOAL:.0%})")
        if not s["decide_p99_ms"] < P99_GOAL_MS:
            out.append(f"scale: Decide p99 {s['decide_p99_ms']:.2f} ms (goal < {P99_GOAL_MS:g} ms)")
        if not s["idle_cpu_share_with_steps"] < IDLE_GOAL:  # the goals hold across decay steps
            out.append(f"scale: idle CPU with the decay step's spread over its period "
                       f"{s['idle_cpu_share_with_steps']:.1%} of a core (goal < {IDLE_GOAL:.0%})")  # fmt: skip
        if not s["decay_step"]["decide_p99_ms"] < P99_GOAL_MS:
            out.append(f"scale: Decide p99 across a decay step {s['decay_step']['decide_p99_ms']:.2f} ms "
                       f"(goal < {P99_GOAL_MS:g} ms)")  # fmt: skip
        st = s["streams"]
        if not st["all_open_within_timeout"]:
            out.append(f"scale: {st['opened']} of {st['streams']} streams open after {OPEN_TIMEOUT_S:.0f} s")
    for name, a in figures.get("attacks", {}).items():
        if name in CONTROLS:
            continue
        if not a["ratio"] <= RATIO_GOAL:
            out.append(f"{name}: p99 {a['p99_before_ms']:.2f} -> {a['p99_during_ms']:.2f} ms ({a['ratio']:.1f}x)")
        if a["failures_during"]:
            out.append(f"{name}: {a['failures_during']} steady calls failed {a['failure_codes_during']}")
    return out


def print_scale(s: dict[str, Any]) -> None:
    print("\nscale: a steady client's Decide beside N WatchDecisions streams (another process)")
    print(f"  {'segments':>8} {'streams':>7}  {'idle CPU':>8}  {'Decide p50':>10} {'p99':>8}  {'calls':>5} "
          f"{'failed':>6} {'>5ms':>4}  {'CPU deciding':>12} {'threads':>7} {'RSS MiB':>7}")  # fmt: skip
    for p in s["points"]:
        flag = "  MISSED" if p is s["points"][-1] and not (p["idle_cpu_share"] < IDLE_GOAL
                                                           and p["decide_p99_ms"] < P99_GOAL_MS) else ""  # fmt: skip
        print(f"  {p['segments']:>8} {p['streams']:>7}  {p['idle_cpu_share']:>8.1%}  {p['decide_p50_ms']:>7.2f} ms "
              f"{p['decide_p99_ms']:>5.2f} ms  {p['decide_calls']:>5} {p['decide_failures']:>6} "
              f"{p['decide_over_deadline']:>4}  {p['cpu_share_deciding']:>12.1%} {p['threads']:>7} "
              f"{p['rss_mib']:>7.0f}{flag}")  # fmt: skip
    st = s["streams"]
    print(f"  streams: the first alone, its first message at {st['seconds_to_first']:.2f} s; {st['opened']} of "
          f"{st['streams']} open at {st['seconds_to_open']:.2f} s (refused {st['refused'] or 'none'}); first message "
          f"{st['full_bytes'] / 1024:.0f} KiB ({st['full_segments']} segments), then "
          f"{st['messages_per_stream_per_second']:.2f} messages/s each, {st['later_mean_bytes'] / 1024:.1f} KiB "
          f"({st['later_mean_segments']:.1f} segments changed) on average; the controller quiet "
          f"{st.get('settle_s', 0.0):.1f} s after")  # fmt: skip
    d = s["decay_step"]
    print(
        f"  across a decay step (from 1 s before, {d['seconds']:.1f} s, the streams open): Decide p50 "
        f"{d['decide_p50_ms']:.2f} ms, p99 {d['decide_p99_ms']:.2f} ms, {d['decide_calls']} calls, "
        f"{d['decide_failures']} failed, {d['decide_over_deadline']} over 5 ms; CPU {d['cpu_share']:.1%} of a core"
        f" ({d['extra_cpu_seconds']:.2f} CPU s beyond the same window without a step)"
    )
    print(f"  idle CPU over a bucket period, the step's extra CPU spread over it: {s['idle_cpu_share_with_steps']:.1%}")
    print(f"  goals, between decay steps and across them: idle < {IDLE_GOAL:.0%} of a core, Decide p99 < "
          f"{P99_GOAL_MS:g} ms")  # fmt: skip
    if s["full_window"]:
        print(f"  every bucket of the window filled for every segment first ({s['window_fill_seconds']:.0f} s)")


def print_attacks(a: dict[str, dict[str, Any]], settings: Settings) -> None:
    print(f"\nattacks: a steady client's Decide ({settings.rate:g}/s) for {settings.seconds:g} s before and "
          f"{settings.seconds:g} s during each; goal: p99 during <= {RATIO_GOAL:g}x before, no failure")  # fmt: skip
    print(f"  {'attack':<20} {'p50 before/during':>19}  {'p99 before/during':>19}  {'ratio':>5}  {'failed':>6} "
          f"{'>5ms':>9}  {'CPU':>11}  {'threads':>9}  {'RSS MiB':>9}")  # fmt: skip
    for name, r in a.items():
        ok = r["ratio"] <= RATIO_GOAL and not r["failures_during"]
        flag = "  (control)" if name in CONTROLS else "" if ok else "  MISSED"
        print(f"  {name:<20} {r['p50_before_ms']:>7.2f} / {r['p50_during_ms']:>5.2f} ms  {r['p99_before_ms']:>7.2f} "
              f"/ {r['p99_during_ms']:>5.2f} ms  {r['ratio']:>4.1f}x  {r['failures_during']:>6} "
              f"{r['over_deadline_before']:>4}/{r['over_deadline_during']:<4}  {r['cpu_share_before']:>4.0%} / "
              f"{r['cpu_share_during']:<4.0%}  {r['threads_before']:>4}/{r['threads_during']:<4}  "
              f"{r['rss_mib_before']:>4.0f}/{r['rss_mib_during']:<4.0f}{flag}")  # fmt: skip
        print(f"  {'':<20} slowest {r['max_before_ms']:.1f} / {r['max_during_ms']:.1f} ms, calls {r['calls_before']} / "
              f"{r['calls_during']} (a paced client held by a stall makes fewer)")  # fmt: skip
        print(f"  {'':<20} {r['what']}: {json.dumps(r['attacker'])}")


def parse(argv: Sequence[str] | None) -> tuple[Settings, list[str], Path | None, Path]:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--segments", type=int, default=defaults.segments)
    parser.add_argument("--streams", type=int, default=defaults.streams, help="WatchDecisions streams")
    parser.add_argument("--seconds", type=float, default=defaults.seconds, help="each window's length")
    parser.add_argument("--rate", type=float, default=defaults.rate, help="the steady client's Decide calls/s")
    parser.add_argument("--half-open", type=int, default=defaults.half_open, help="calls per kind of caller")
    parser.add_argument("--health-streams", type=int, default=defaults.health_streams)
    parser.add_argument("--flood-threads", type=int, default=defaults.flood_threads)
    parser.add_argument("--bucket-seconds", type=float, default=defaults.bucket_seconds,
                        help="the scale controller's bucket_seconds: its decay step")  # fmt: skip
    parser.add_argument("--no-pin", action="store_true", help="leave every process free to run on any CPU")
    parser.add_argument("--full-window", action="store_true", help="fill every bucket of the scale controller's "
                        "learning window (60) for every segment before the points at full scale")  # fmt: skip
    parser.add_argument("--only", default=",".join(["scale", *ATTACKS]), help="comma-separated phase names")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this file")
    parser.add_argument("--root", type=Path, default=None, help="the controllers' state and logs (default: a new "
                        "temporary folder)")  # fmt: skip
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n != "scale" and n not in ATTACKS]
    if unknown:
        parser.error(f"unknown phases {unknown}; known: scale, {', '.join(ATTACKS)}")
    if args.segments < BASELINE_SEGMENTS or args.streams < 1 or min(args.seconds, args.rate, args.bucket_seconds) <= 0:
        parser.error(f"--segments must be at least {BASELINE_SEGMENTS}, --streams 1, --seconds, --rate and "
                     "--bucket-seconds above 0")  # fmt: skip
    settings = Settings(args.segments, args.streams, args.seconds, args.rate, args.half_open, args.health_streams,
                        args.flood_threads, args.bucket_seconds, pin=not args.no_pin,
                        full_window=args.full_window)  # fmt: skip
    return settings, names, args.json, args.root or Path(tempfile.mkdtemp(prefix="specd-bench-scale-"))


def main(argv: Sequence[str] | None = None) -> int:
    settings, names, json_path, root = parse(argv)
    cores = Cores.split(settings.pin)
    if cores is None:
        return run(settings, names, json_path, root, cores)
    free = frozenset(os.sched_getaffinity(0))
    pin_this_process(cores.attacker)
    try:
        return run(settings, names, json_path, root, cores)
    finally:
        pin_this_process(free)  # (a caller in this process, a test, goes on unpinned)


def run(settings: Settings, names: Sequence[str], json_path: Path | None, root: Path, cores: Cores | None) -> int:
    where = ("not pinned" if cores is None else f"controller and steady client on CPU {sorted(cores.victim)}, "
             f"attackers on {sorted(cores.attacker)}")  # fmt: skip
    print(f"{os.cpu_count()} CPUs ({where}); {asdict(settings)}; logs under {root}", flush=True)
    figures: dict[str, Any] = {"cpus": os.cpu_count(), "settings": asdict(settings),
                               "pinned": None if cores is None else {"victim": sorted(cores.victim),
                                                                      "attacker": sorted(cores.attacker)}}  # fmt: skip
    if "scale" in names:
        print("--- scale", flush=True)
        figures["scale"] = scale(root, settings, cores)
        print_scale(figures["scale"])
    hostile = [n for n in names if n != "scale"]
    if hostile:
        figures["attacks"] = attacks(root, hostile, settings, cores)
        print_attacks(figures["attacks"], settings)
    figures["missed"] = missed(figures)
    print("\n" + ("\n".join(f"MISSED {m}" for m in figures["missed"]) if figures["missed"] else "every goal met"))
    if json_path is not None:
        json_path.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
