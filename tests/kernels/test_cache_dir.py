"""``$XINSERVE_CACHE_DIR`` is resolved in one place, and every cache of xinserve lives under it."""

from pathlib import Path

import xinserve.engines.worker.graphs
import xinserve.kernels.cpu.cpp_build
import xinserve.kernels.probes.timing
import xinserve.server.embedded_model.resolve
from xinserve.kernels.cache_dir import cache_dir


def test_the_cache_dir_is_the_variable_else_the_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("XINSERVE_CACHE_DIR", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "xinserve"
    monkeypatch.setenv("XINSERVE_CACHE_DIR", "")  # empty counts as unset
    assert cache_dir() == Path.home() / ".cache" / "xinserve"
    monkeypatch.setenv("XINSERVE_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path


def test_the_embedded_model_kernel_timings_inductor_and_the_cpp_build_share_it(monkeypatch, tmp_path):
    monkeypatch.setenv("XINSERVE_CACHE_DIR", str(tmp_path))
    assert xinserve.server.embedded_model.resolve.cache_dir is cache_dir
    assert xinserve.kernels.probes.timing.cache_path() == tmp_path / "kernel_timings.json"
    assert xinserve.engines.worker.graphs.inductor_cache_dir() == tmp_path / "inductor"
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)  # the C++ kernels' build, unless it says otherwise
    assert xinserve.kernels.cpu.cpp_build._build_dir("k") == tmp_path / "torch_extensions" / "paged_decode_k"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "elsewhere"))
    assert xinserve.kernels.cpu.cpp_build._build_dir("k") == tmp_path / "elsewhere" / "paged_decode_k"
