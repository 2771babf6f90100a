"""llama.cpp's ``llama-server``, built from source a package registry serves: the llama-cpp-python source
distribution vendors llama.cpp (its ``tools/server`` included). Only the server binary is built (CMake, the CPU
backend, this machine's instructions: ``GGML_NATIVE``), then kept in a cache folder; a second call finds it there and
builds nothing. A rebuilt machine (or another CPU) builds again.

    python -m specd.llama.build [--jobs N] [--force]     # prints the binary's path

The cache: ``$SPECD_CACHE`` or ``~/.cache/specd``, under ``llama-server/<sdist version>/<CPU key>/``: the key is a
hash of the CPU's instruction-set flags, since a native build may not run on another CPU. ``$SPECD_LLAMA_SERVER``
names a binary to use instead (never built over). The build needs cmake and a C++ compiler; the binary is linked
statically against llama.cpp's own libraries.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from specd_api.errors import SpecdError

SDIST = "llama-cpp-python"
VERSION = "0.3.36"  # its vendored llama.cpp is what runs; a new version is a new cache folder
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",  # this CPU's instructions (AVX2, AVX-512 ...): the cache is per machine
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",  # models are files here; nothing downloads
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
)


class BuildFailed(SpecdError):
    pass


# The instruction sets a native ggml build may use: a binary built where one of them is present may not run without it.
ISA_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
    "avx512_bf16", "avx512vbmi", "amx_tile", "amx_int8", "amx_bf16", "asimd", "sve",
)  # fmt: skip


def cache_root() -> Path:
    return Path(os.environ.get("SPECD_CACHE") or Path.home() / ".cache" / "specd")


def cpu_key() -> str:
    """8 hex digits naming this CPU's instruction sets (from /proc/cpuinfo; "generic" where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "generic"
    flags = set().union(*(line.split(":", 1)[1].split() for line in text.splitlines()
                          if line.startswith(("flags", "Features")) and ":" in line))  # fmt: skip
    present = ",".join(flag for flag in ISA_FLAGS if flag in flags)
    return hashlib.sha256(present.encode()).hexdigest()[:8]


def binary_path(version: str = VERSION) -> Path:
    """Where the server is (or will be built): ``$SPECD_LLAMA_SERVER`` when set, else the cache's for this CPU."""
    given = os.environ.get("SPECD_LLAMA_SERVER")
    if given:
        return Path(given)
    return cache_root() / "llama-server" / version / cpu_key() / "bin" / "llama-server"


def built(version: str = VERSION) -> Path | None:
    """The server binary if it is there and runs, else None."""
    path = binary_path(version)
    if not path.is_file():
        return None
    try:
        subprocess.run([str(path), "--version"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return path


def _run(command: list[str], log: Path, what: str) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text().splitlines()[-15:]
        raise BuildFailed(f"{what} failed (exit {done.returncode}); the log's end ({log}):\n" + "\n".join(tail))


def _fetch_source(work: Path, log: Path, version: str) -> Path:
    """The sdist from the package registry pip is set up for, unpacked: the vendored llama.cpp's folder."""
    download = work / "sdist"
    _run([sys.executable, "-m", "pip", "download", f"{SDIST}=={version}", "--no-deps", "--no-binary", ":all:",
          "--dest", str(download), "--quiet"], log, f"pip download {SDIST}=={version}")  # fmt: skip
    archives = sorted(download.glob("*.tar.gz"))
    if not archives:
        raise BuildFailed(f"pip download {SDIST}=={version} gave no source archive in {download}")
    with tarfile.open(archives[0]) as archive:
        members = [m for m in archive.getmembers() if "/vendor/llama.cpp/" in m.name]
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later: no links or paths out of the folder
            archive.extractall(work / "src", members=members, filter="data")
        else:
            archive.extractall(work / "src", members=[m for m in members if m.isfile() or m.isdir()])
    found = sorted((work / "src").glob("*/vendor/llama.cpp"))
    if not found:
        raise BuildFailed(f"{archives[0].name} holds no vendor/llama.cpp")
    return found[0]


def build(version: str = VERSION, jobs: int | None = None, force: bool = False) -> Path:
    """The server binary: the cached one, or built now (minutes). Raises BuildFailed with the log's end."""
    if os.environ.get("SPECD_LLAMA_SERVER"):
        given = built(version)
        if given is None:
            raise BuildFailed(f"SPECD_LLAMA_SERVER names {binary_path(version)}, which does not run (--version)")
        return given
    if not force and (ready := built(version)) is not None:
        return ready
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise BuildFailed(f"building llama-server needs {tool!r} on PATH")
    try:
        return _build(version, jobs)
    except OSError as e:
        raise BuildFailed(
            f"{e.strerror or e} ({e.filename or cache_root()}): set SPECD_CACHE to a writable folder"
        ) from None


def _build(version: str, jobs: int | None) -> Path:
    target = binary_path(version)
    target.parent.mkdir(parents=True, exist_ok=True)
    log = target.parent.parent / "build.log"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="specd-llama-build-") as tmp:
        work = Path(tmp)
        source = _fetch_source(work, log, version)
        build_dir = work / "build"
        _run(["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_OPTIONS], log, "cmake (configure)")
        _run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 2)],
             log, "cmake --build (llama-server)")  # fmt: skip
        produced = build_dir / "bin" / "llama-server"
        if not produced.is_file():
            raise BuildFailed(f"the build finished without {produced}")
        partial = target.with_name(target.name + ".partial")
        shutil.copy2(produced, partial)
        os.replace(partial, target)  # whole or not at all: a build cut short leaves no binary that half runs
    if built(version) is None:
        raise BuildFailed(f"{target} was built but does not run (`{target} --version`)")
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specd.llama.build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=None, metavar="N", help="parallel compile jobs (default: cores)")
    parser.add_argument("--force", action="store_true", help="build even when the cache holds the binary")
    args = parser.parse_args(argv)
    try:
        path = build(jobs=args.jobs, force=args.force)
    except BuildFailed as e:
        print(f"llama-server: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
