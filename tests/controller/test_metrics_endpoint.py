"""The controller's Prometheus endpoint over the real path: `specd controller` as a process with
`metrics.listen` in its YAML, real Redis, reports over gRPC, GET /metrics over HTTP. What a scrape shows of a segment
is what GetSegmentStats answers; metrics are off unless asked for; a bad address or a busy port stops the start in one
line; a scrape survives a segment that cannot be read, its time bound and a Redis outage."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from controller.config import ControllerConfig, MetricsConfig, load_config
from controller.decision.core import SegmentView
from controller.serving.metrics_endpoint import MetricsServer, SegmentCollector, serve_metrics, start_metrics_server
from specd import launch
from specd_api.v1 import controller_pb2 as pb
from specd_api.v1 import controller_pb2_grpc as pb_grpc
from specd_api.yaml_config import ConfigError
from tests.controller.test_calibration_service import draft_request, send, until
from tests.controller.test_redis_outage import EmbeddedServer
from tests.daemons import DEFAULT_POLICY, RPC_TIMEOUT, connected, running_daemon
from tests.waiting import free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# --- helpers --------------------------------------------------------------------------------------------------------


def get(url: str) -> tuple[int, str]:
    """One HTTP GET: (status, body)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def scrape(address: str) -> Samples:
    """GET /metrics at ``address`` (host:port), which must answer 200: every sample by name and sorted labels."""
    status, text = get(f"http://{address}/metrics")
    assert status == 200, text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def segment_of(samples: Samples, name: str) -> set[str]:
    """The segments ``name`` has a sample for."""
    return {dict(labels)["segment"] for n, labels in samples if n == name}


def controller_yaml(folder: Path, redis_url: str, grpc_port: int, metrics: str) -> Path:
    """A controller config for `specd controller`: its own key prefix, fast refreshes, no decay within a test."""
    path = folder / "controller.yaml"
    path.write_text(
        f"listen: 127.0.0.1:{grpc_port}\nredis_url: {redis_url}\npolicy_path: {DEFAULT_POLICY}\n"
        f"state_dir: {folder / 'state'}\nshutdown_grace_seconds: 2\n"
        f"learning: {{prefix: m{grpc_port}, refresh_seconds: 0.1, half_life_seconds: 1.0e7}}\n{metrics}"
    )
    return path


def calibrate(stub: pb_grpc.ControllerStub, segment: str) -> pb.SegmentStats:
    """Costs first (10 reports elsewhere), then 5 requests of ``segment`` that each realised 0.8 of the speedup
    their plan promised (tests/controller/test_calibration_service.py); returns its stats once all 5 count."""
    for _ in range(10):
        send(stub, draft_request(f"{segment}-warm-up"))
    wait_until(
        lambda: any(b.step_seconds > 0 for b in stub.GetCosts(pb.GetCostsRequest(), timeout=RPC_TIMEOUT).buckets),
        what="the costs measured",
    )
    for _ in range(5):
        send(stub, draft_request(segment, expected=44 / 38 / 0.8))
    return until(
        lambda: stub.GetSegmentStats(pb.GetSegmentStatsRequest(segment=segment), timeout=RPC_TIMEOUT),
        lambda s: any(d.calibration_requests >= 4.99 for d in s.drafters),
    )


def listening_ports() -> set[int]:
    """TCP ports this process listens on (/proc: its socket inodes in the LISTEN state)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def refuses_connections(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return True
    return False


@pytest.fixture
def endpoints() -> Iterator[list[MetricsServer]]:
    """Metrics servers a test starts itself, closed after it."""
    servers: list[MetricsServer] = []
    yield servers
    for server in servers:
        server.close()


# --- the real path: a `specd controller` process --------------------------------------------------------------------


def test_a_scrape_shows_the_calibration_get_segment_stats_serves(tmp_path, embedded_redis_url):
    config = controller_yaml(tmp_path, embedded_redis_url, free_port(), 'metrics: {listen: "127.0.0.1:0"}\n')
    service = launch.start("controller", ["controller", "--config", str(config)], cwd=REPO, timeout_seconds=120)
    try:
        line = next(line for line in service.tail if "listening on" in line)
        assert re.search(rf"specd controller listening on {re.escape(service.address)} \(", line), line
        found = re.search(r"; metrics at http://(127\.0\.0\.1:(\d+))/metrics$", line.rstrip())
        assert found and int(found.group(2)) != 0, line  # port 0: the port chosen is the one printed
        address = found.group(1)

        with grpc.insecure_channel(service.address) as channel:
            stub = pb_grpc.ControllerStub(channel)
            stats = calibrate(stub, "calibrated")
            samples = scrape(address)
            text = get(f"http://{address}/metrics")[1]
        draft = next(d for d in stats.drafters if d.drafter == "draft")
        assert draft.calibration == pytest.approx(0.8, rel=0.05)
        labels = {"segment": "calibrated", "drafter": "draft"}
        # the same figures (decay with a half-life of 10^7 s moves a count by 10^-7 in the second between them)
        assert sample(samples, "specd_controller_calibration", **labels) == pytest.approx(draft.calibration, rel=1e-6)
        assert sample(samples, "specd_controller_calibration_requests", **labels) == pytest.approx(
            draft.calibration_requests, rel=1e-6
        )
        # only where a request measured it, as `specd segments` shows it: the warm-up segment promised nothing
        assert segment_of(samples, "specd_controller_calibration") == {"calibrated"}
        assert {dict(labels)["drafter"] for n, labels in samples if n == "specd_controller_calibration"} == {"draft"}
        decision = stats.decision
        assert sample(samples, "specd_controller_decision_k", segment="calibrated", drafter=decision.drafter) == (
            decision.k
        )
        assert sample(samples, "specd_controller_alpha", **labels) == pytest.approx(0.5)  # 2 of 4 per round
        assert sample(samples, "specd_controller_segment_rounds", segment="calibrated") == pytest.approx(
            stats.rounds, rel=1e-6
        )
        assert sample(samples, "specd_controller_segments") == 2
        assert sample(samples, "specd_controller_stale") == 0
        assert sample(samples, "specd_controller_metrics_scrape_errors_total") == 0
        assert "# TYPE specd_controller_alpha_drift_alarms_total counter" in text  # the registry's own series
        assert get(f"http://{address}/")[0] == 404  # one path

        assert service.stop() == 0  # SIGTERM: drained, and the metrics port closed with it
        output = "".join(service.tail)
        assert "Traceback" not in output and "drained in" in output
        assert refuses_connections(address)
    finally:
        service.kill()


def test_a_busy_metrics_port_stops_the_start_in_one_line(tmp_path, embedded_redis_url):
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        config = controller_yaml(tmp_path, embedded_redis_url, free_port(), f"metrics: {{listen: 127.0.0.1:{busy}}}\n")
        done = subprocess.run([sys.executable, "-m", "specd", "controller", "--config", str(config)], cwd=REPO,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    error = f"specd controller: error: cannot serve metrics on 127.0.0.1:{busy}: Address already in use"
    assert error in done.stderr.splitlines(), done.stderr
    assert "Traceback" not in done.stderr
    assert "listening on" not in done.stderr  # it never served


BAD_LISTEN = [
    pytest.param("9461", "must be host:port", id="no-host"),
    pytest.param("127.0.0.1:65536", "the port must be a number in 0..65535", id="port-too-large"),
    pytest.param("127.0.0.1:http", "the port must be a number in 0..65535", id="port-not-a-number"),
    pytest.param("::1:9461", "an IPv6 address is written [address]:port", id="bare-ipv6"),
    pytest.param("[not-v6]:9461", "'not-v6' in brackets is not an IPv6 address", id="bracketed-non-ipv6"),
    pytest.param("unix:/run/specd.sock", "the port must be a number", id="unix-socket"),
]


@pytest.mark.parametrize(("listen", "reason"), BAD_LISTEN)
def test_a_bad_metrics_address_names_file_line_field_and_reason(tmp_path, listen, reason):
    path = tmp_path / "controller.yaml"
    path.write_text(f'listen: 127.0.0.1:0\nmetrics:\n  listen: "{listen}"\n')
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert f"{path}:3: metrics.listen: Value error, {reason}" in str(raised.value)


def test_a_bad_metrics_address_stops_the_command_in_one_line(tmp_path):
    path = tmp_path / "controller.yaml"
    path.write_text('listen: 127.0.0.1:0\nmetrics: {listen: "9461"}\n')
    done = subprocess.run([sys.executable, "-m", "specd", "controller", "--config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 2
    assert f"{path}:2: metrics.listen" in done.stderr and "Traceback" not in done.stderr


# --- in process: off by default, and what a scrape survives ---------------------------------------------------------


def test_metrics_are_off_by_default_and_no_port_is_bound(tmp_path, embedded_redis_url, caplog):
    assert ControllerConfig().metrics.listen is None
    caplog.set_level(logging.INFO, logger="specd")
    before = listening_ports()
    with running_daemon(embedded_redis_url, tmp_path, DEFAULT_POLICY.read_text()) as daemon:
        assert daemon.metrics is None
        assert listening_ports() - before == {daemon.port}  # gRPC's, and nothing else
    line = next(r.getMessage() for r in caplog.records if "listening on" in r.getMessage())
    assert "; metrics at" not in line and line.endswith(")")


def test_a_segment_that_cannot_be_read_leaves_the_rest_served(tmp_path, embedded_redis_url, endpoints, monkeypatch):
    with running_daemon(embedded_redis_url, tmp_path, DEFAULT_POLICY.read_text()) as daemon, connected(daemon) as ch:
        controller = daemon.controller
        assert controller is not None
        for segment in ("alpha-a", "alpha-b", "broken"):
            send(pb_grpc.ControllerStub(ch), draft_request(segment))
        wait_until(lambda: len(controller.learner.segments()) == 3, what="3 segments seen")
        endpoints.append(serve_metrics(controller, MetricsConfig(listen="127.0.0.1:0"), 1001))
        address = endpoints[-1].address
        assert segment_of(scrape(address), "specd_controller_segment_rounds") == {"alpha-a", "alpha-b", "broken"}

        view = controller.segment_view

        def failing(segment: str) -> SegmentView:
            if segment == "broken":
                raise RuntimeError("injected")
            return view(segment)

        monkeypatch.setattr(controller, "segment_view", failing)
        for errors in (1, 2):  # a counter: each failed scrape of the segment adds one
            samples = scrape(address)
            assert segment_of(samples, "specd_controller_segment_rounds") == {"alpha-a", "alpha-b"}
            assert sample(samples, "specd_controller_metrics_scrape_errors_total") == errors
            assert sample(samples, "specd_controller_metrics_segments_left_out") == 1
            assert sample(samples, "specd_controller_segments") == 3

        # The bounds, on a registry of their own: the segment cap, then the time bound (a clock a second a read).
        registry = CollectorRegistry()
        capped = SegmentCollector(controller, max_segments=2, max_seconds=60.0)
        registry.register(capped)
        endpoints.append(start_metrics_server("127.0.0.1", 0, registry))
        samples = scrape(endpoints[-1].address)
        assert len(segment_of(samples, "specd_controller_segment_rounds")) == 2
        assert sample(samples, "specd_controller_metrics_segments_left_out") == 1
        assert sample(samples, "specd_controller_metrics_scrape_errors_total") == 0  # a cap is not an error

        ticks = iter(range(1_000_000))
        monkeypatch.setattr(controller, "segment_view", view)
        slow = SegmentCollector(controller, max_segments=1001, max_seconds=1.5, clock=lambda: next(ticks))
        registry = CollectorRegistry()
        registry.register(slow)
        endpoints.append(start_metrics_server("127.0.0.1", 0, registry))
        samples = scrape(endpoints[-1].address)
        exported = segment_of(samples, "specd_controller_segment_rounds")
        assert 0 < len(exported) < 3, exported
        assert sample(samples, "specd_controller_metrics_segments_left_out") == 3 - len(exported)
        assert sample(samples, "specd_controller_metrics_scrape_errors_total") == 1  # cut short: counted


def test_stored_entries_the_controller_skips_are_counted_and_logged_once(tmp_path, embedded_redis_url, endpoints,
                                                                          caplog):  # fmt: skip
    """Stored data the controller cannot read is skipped, counted in /metrics and logged once per key:
    a prior that is a list, read at every refresh."""
    from controller.storage.redis_conn import make_client

    caplog.set_level(logging.WARNING, logger="controller.storage.store")
    with running_daemon(embedded_redis_url, tmp_path, DEFAULT_POLICY.read_text()) as daemon:
        controller = daemon.controller
        assert controller is not None
        endpoints.append(serve_metrics(controller, MetricsConfig(listen="127.0.0.1:0"), 1001))
        address = endpoints[-1].address
        assert sample(scrape(address), "specd_controller_stored_entries_skipped_total") == 0
        key = controller.learner.store.keys.prior()
        client = make_client(embedded_redis_url, 2.0)
        try:
            client.rpush(key, "not a prior")
            wait_until(lambda: controller.learner.store.skipped.count >= 3, what="three refreshes skip the prior")
            skipped = sample(scrape(address), "specd_controller_stored_entries_skipped_total")
            assert skipped is not None and skipped >= 3, skipped
        finally:
            client.delete(key)
            client.close()
    logged = [r for r in caplog.records if key in r.getMessage()]
    assert len(logged) == 1, [r.getMessage() for r in logged]


@pytest.fixture
def own_redis(tmp_path: Path) -> Iterator[EmbeddedServer]:
    """A Redis of this test's own, to stop and start again (tests/controller/test_redis_outage.py)."""
    server = EmbeddedServer(tmp_path / "r")  # short: the unix socket path must fit in 108 bytes
    yield server
    server.stop()


def test_a_scrape_while_redis_is_down_answers_from_memory(tmp_path, own_redis, endpoints):
    url = own_redis.start()
    with running_daemon(url, tmp_path, DEFAULT_POLICY.read_text()) as daemon, connected(daemon) as channel:
        controller = daemon.controller
        assert controller is not None
        stats = calibrate(pb_grpc.ControllerStub(channel), "remembered")
        draft = next(d for d in stats.drafters if d.drafter == "draft")
        endpoints.append(serve_metrics(controller, MetricsConfig(listen="127.0.0.1:0"), 1001))
        address = endpoints[-1].address
        labels = {"segment": "remembered", "drafter": "draft"}
        assert sample(scrape(address), "specd_controller_calibration", **labels) == pytest.approx(draft.calibration)

        own_redis.stop()
        try:
            wait_until(lambda: controller.learner.stale, what="the controller sees Redis down")
            samples = scrape(address)
            assert sample(samples, "specd_controller_stale") == 1
            assert sample(samples, "specd_controller_calibration", **labels) == pytest.approx(draft.calibration)
            assert sample(samples, "specd_controller_metrics_scrape_errors_total") == 0
        finally:
            own_redis.start()  # the daemon's clean-up deletes its keys
        wait_until(lambda: not controller.learner.stale, what="the controller sees Redis back")
        assert sample(scrape(address), "specd_controller_stale") == 0
