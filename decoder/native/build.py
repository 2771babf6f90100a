"""Compile ``llama_step.c`` once per machine and load it with ctypes.

The library is built with the system's ``gcc`` on first use (about a second) into a cache folder keyed by the
source, the flags and the compiler, then reused. It links OpenMP as ``libgomp.so.1``, which resolves to the runtime
torch has already loaded, so the pass shares torch's threads instead of starting a second pool.

One build per instruction set (``ISAS``): AVX2 + FMA everywhere, and AVX512-BF16 dot products for the matrix
products where the CPU reports ``avx512_bf16``. The best one this CPU runs is chosen once per process, or the one
``SPECD_NATIVE_ISA`` names (``avx2`` on a machine that has more: every path below the best can be tested).

Nothing here raises: ``load()`` returns ``None`` with a reason (``why_not()``) when the machine cannot build or run
the kernel (no gcc, no AVX2, not x86-64, ``SPECD_NATIVE=0``, ``SPECD_NATIVE_ISA`` naming a build the CPU cannot
run), and the engine then runs its PyTorch forward.
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
from dataclasses import dataclass
from functools import cache
from pathlib import Path

log = logging.getLogger("specd.native")

SOURCE = Path(__file__).with_name("llama_step.c")
FLAGS = ("-O3", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
REQUIRED_FLAGS = frozenset({"avx2", "fma"})  # FLAGS' instruction sets
DISABLE_ENV = "SPECD_NATIVE"  # "0" turns the native pass off
CACHE_ENV = "SPECD_NATIVE_CACHE"  # where built libraries go (default: ~/.cache/specd/native)
ISA_ENV = "SPECD_NATIVE_ISA"  # which products to run (default: the best this CPU has)


@dataclass(frozen=True)
class Isa:
    """One build of ``llama_step.c``: the products it runs, the flags that build it, what the CPU must report."""

    name: str
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]


# Worst first. Each build keeps AVX2 + FMA for everything but the products (attention, norms, float32 panels), so
# a better build only adds to what the CPU must have. (AMX tiles are not built: see docs/BENCHMARKS.md.)
ISAS = (
    Isa("avx2", FLAGS, REQUIRED_FLAGS),
    Isa(
        "avx512bf16",
        (*FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-DSPECD_ISA_AVX512BF16"),
        REQUIRED_FLAGS | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"},
    ),
)
ISA_NAMES = tuple(isa.name for isa in ISAS)


@cache
def _status(name: str) -> tuple[ctypes.CDLL | None, str]:
    """The library built for ISA ``name`` (one of ``ISA_NAMES``), or None and why not."""
    if os.environ.get(DISABLE_ENV, "1").strip() == "0":
        return None, f"{DISABLE_ENV}=0"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None, f"not an x86-64 CPU ({platform.machine()})"
    isa = next(isa for isa in ISAS if isa.name == name)
    missing = sorted(isa.cpu_flags - _cpu_flags())
    if missing:
        return None, f"the CPU lacks {', '.join(missing)}"
    compiler = shutil.which("gcc")
    if compiler is None:
        return None, "no gcc on PATH"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256(SOURCE.read_bytes() + " ".join(isa.flags).encode() + version.encode()).hexdigest()[:16]
        library = _cache_dir() / f"libspecd_llama-{isa.name}-{key}.so"
        if not library.exists():
            _compile(compiler, isa.flags, library)
        return ctypes.CDLL(str(library)), ""
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"building {SOURCE.name} failed: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}"


@cache
def _selected() -> tuple[str, str]:
    """The ISA this process runs, and a note when it is not the one asked for: ``SPECD_NATIVE_ISA`` when set (a
    name this CPU cannot run is refused, not quietly replaced), else the best build that works here."""
    asked = os.environ.get(ISA_ENV, "").strip().lower()
    if asked:
        if asked not in ISA_NAMES:
            return "", f"{ISA_ENV}={asked!r} is not one of {', '.join(ISA_NAMES)}"
        reason = _status(asked)[1]
        return asked, f"{ISA_ENV}={asked}: {reason}" if reason else ""
    for isa in reversed(ISAS):
        if _status(isa.name)[0] is not None or isa is ISAS[0]:
            return isa.name, ""
    raise AssertionError("unreachable")


def reselect() -> None:
    """Read ``SPECD_NATIVE_ISA`` again (tests and benchmarks that compare builds in one process; pools and packed
    weights made before keep the build they were made with)."""
    _selected.cache_clear()


def selected_isa() -> str:
    """The name of the build ``load()`` returns (empty when ``SPECD_NATIVE_ISA`` names none)."""
    return _selected()[0]


def available_isas() -> list[str]:
    """Every build this machine can run, worst first (for tests and benchmarks that compare them)."""
    return [isa.name for isa in ISAS if _status(isa.name)[0] is not None]


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


def _compile(compiler: str, flags: tuple[str, ...], library: Path) -> None:
    # into a private name first: two processes building at once each rename a complete file into place
    partial = library.with_name(f".{library.name}.{os.getpid()}")
    result = subprocess.run(
        [compiler, *flags, "-o", str(partial), str(SOURCE), "-lm"], capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        first = (result.stderr.strip().splitlines() or ["(no output)"])[0]
        raise OSError(f"gcc exited {result.returncode}: {first}")
    os.replace(partial, library)
    log.info("built %s", library)


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The native library for ``isa`` (default: ``selected_isa()``), or None when this machine cannot use it
    (``why_not(isa)`` says why)."""
    if isa is None:
        isa, note = _selected()
        if note:
            return None
    return _status(isa)[0]


def why_not(isa: str | None = None) -> str:
    """Why ``load(isa)`` returned None; empty when it did not."""
    if isa is None:
        isa, note = _selected()
        if note:
            return note
    return _status(isa)[1]
