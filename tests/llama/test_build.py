"""What the llama-server build does without building: a named binary that does not run, and a cache it cannot write,
are refused in one line; the cache is kept per CPU (a native build may not run on another)."""

from __future__ import annotations

import pytest

from specd.llama import build


def test_a_named_server_that_does_not_run_is_refused(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECD_LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(build.BuildFailed, match="does not run"):
        build.build()
    assert not (tmp_path / "missing").exists(), "nothing is built over a named binary"


def test_a_cache_it_cannot_write_is_refused_naming_the_setting(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECD_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path / "file-not-folder"))
    (tmp_path / "file-not-folder").write_text("")
    if build.built() is None and (build.shutil.which("cmake") is None or build.shutil.which("c++") is None):
        pytest.skip("no cmake or c++ here: the build stops before the cache")
    with pytest.raises(build.BuildFailed, match="SPECD_CACHE"):
        build.build()


def test_the_cache_is_per_cpu(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECD_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    path = build.binary_path()
    assert path.parts[-4:] == (build.VERSION, build.cpu_key(), "bin", "llama-server")
    assert len(build.cpu_key()) == 8 or build.cpu_key() == "generic"
