"""Compile ``llama_step.c`` once per machine and load it with ctypes.

The library is built with the system's ``gcc`` on first use (about a second) into a cache folder keyed by the
source, the flags and the compiler, then reused. It links OpenMP as ``libgomp.so.1``, which resolves to the runtime
torch has already loaded, so the pass shares torch's threads instead of starting a second pool.

Nothing here raises: ``load()`` returns ``None`` with a reason (``why_not()``) when the machine cannot build or run
the kernel (no gcc, no AVX2, not x86-64, ``SPECD_NATIVE=0``), and the engine then runs its PyTorch forward.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger("specd.native")

SOURCE = Path(__file__).with_name("llama_step.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
REQUIRED_FLAGS = frozenset({"avx2", "fma"})  # FLAGS' instruction sets
DISABLE_ENV = "SPECD_NATIVE"  # "0" turns the native pass off
CACHE_ENV = "SPECD_NATIVE_CACHE"  # where built libraries go (default: ~/.cache/specd/native)


@cache
def _status() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        return None, f"{DISABLE_ENV}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"not an x86-64 CPU ({platform.machine()})"
    missing = sorted(REQUIRED_FLAGS - _cpu_flags())
    if missing:
        return None, f"the CPU lacks {', '.join(missing)}"
    compiler = shutil.which("gcc")
    if compiler is None:
        return None, "no gcc on PATH"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
        library = _cache_dir() / f"libspecd_llama-{key}.so"
        if not library.exists():
            _compile(compiler, library)
        return ctypes.CDLL(str(library)), ""
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building {SOURCE.name} failed: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}"


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere, which reads as lacking AVX2)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    configured = os.environ.get(CACHE_ENV)
    folder = Path(configured) if configured else Path.home() / ".cache" / "specd" / "native"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    except OSError:
        fallback = Path(tempfile.gettempdir()) / f"specd-native-{os.getuid()}"
        fallback.mkdir(parents=True, exist_ok=True)
        return fallback


def _compile(compiler: str, library: Path) -> None:
    # into a private name first: two processes building at once each rename a complete file into place
    partial = library.with_name(f".{library.name}.{os.getpid()}")
    result = subprocess.run(
        [compiler, *FLAGS, "-o", str(partial), str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        first = (result.stderr.strip().splitlines() or ["(no output)"])[0]
        raise OSError(f"gcc exited {result.returncode}: {first}")
    os.replace(partial, library)
    log.info("built %s", library)


def load() -> ctypes.CDLL | None:
    """The native library, or None when this machine cannot use it (``why_not()`` says why)."""
    return _status()[0]


def why_not() -> str:
    """Why ``load()`` returned None; empty when it did not."""
    return _status()[1]
