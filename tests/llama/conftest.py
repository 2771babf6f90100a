"""llama.cpp's server for tests: the binary `make llama-server` builds (cached; a run without it skips, saying so),
the shipped pair exported to GGUF once per session, and ``llama_server``, one server process on a free port."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from specd.llama.build import built
from specd.llama.gguf_export import export

REFERENCE = Path(__file__).resolve().parents[2] / "models" / "reference"
START_SECONDS = 60.0


@pytest.fixture(scope="session")
def server_binary() -> Path:
    path = built()
    if path is None:
        pytest.skip("llama-server is not built here: `make llama-server` builds it (minutes; cached)")
    return path


@pytest.fixture(scope="session")
def gguf_pair(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    return {name: export(REFERENCE / name, out / f"{name}.gguf") for name in ("target", "draft")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def llama_server(binary: Path, model: Path, *args: str, log: Path) -> Iterator[str]:
    """A llama-server on 127.0.0.1 serving ``model`` (one slot, two threads), its base URL once /health answers."""
    port = free_port()
    command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c", "1024",
               "-np", "1", "--no-webui", *args]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            if process.poll() is not None:
                raise AssertionError(f"llama-server exited {process.returncode}: {log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"llama-server did not answer /health in {START_SECONDS:.0f}s")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
