"""llama.cpp's server for tests: the binary `make llama-server` builds (cached; a run without it skips, saying so),
the shipped pair exported to GGUF once per session, and ``llama_server``, one server process on a free port."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from specd.llama.build import built
from specd.llama.gguf_export import export
from specd.llama.server import running

REFERENCE = Path(__file__).resolve().parents[2] / "models" / "reference"


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


@contextmanager
def llama_server(binary: Path, model: Path, *args: str, log: Path) -> Iterator[str]:
    """A llama-server on 127.0.0.1 serving ``model`` (one slot, two threads), its base URL once /health answers."""
    with running(binary, model, args, log=log) as url:
        yield url
