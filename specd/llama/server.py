"""One ``llama-server`` process on a free loopback port, for as long as a ``with`` block lasts: started, waited for
until ``/health`` answers, stopped (SIGTERM, then SIGKILL after 10 s)."""

from __future__ import annotations

import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from specd_api.errors import SpecdError

START_SECONDS = 60.0


class ServerFailed(SpecdError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tokens(url: str, text: str) -> list[int]:
    """``text`` as the server at ``url`` tokenizes a prompt (its special tokens added: ``/tokenize``)."""
    import httpx

    answer = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": True}, timeout=30)
    answer.raise_for_status()
    return [int(t) for t in answer.json()["tokens"]]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextmanager
def running(
    binary: Path, model: Path, args: Sequence[str] = (), *, log: Path, threads: int = 2, context: int = 1024
) -> Iterator[str]:
    """``binary`` serving ``model`` on 127.0.0.1 with one slot (plus ``args``), its output in ``log``; yields its
    base URL once /health answers. Raises ServerFailed (with the log's end) if it exits or does not answer within
    START_SECONDS."""
    port = free_port()
    command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
               "-c", str(context), "-np", "1", "--no-webui", *args]  # fmt: skip
    with log.open("w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_SECONDS
        while not healthy(url):
            if process.poll() is not None:
                raise ServerFailed(f"llama-server exited {process.returncode}: {log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise ServerFailed(f"llama-server did not answer /health in {START_SECONDS:.0f} s ({log})")
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
