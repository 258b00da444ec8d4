"""The embedded default model written directly (server/embedded_model/llama_files.py): the same bytes as
the factory's build through transformers' model classes, built inside the HTTP process on first use."""

import resource
from pathlib import Path

import pytest

from xinserve.server.embedded_model.llama_files import write_llama
from xinserve.server.embedded_model.resolve import resolve_model_path
from xinserve.server.model_settings import ModelSettings


def _same_files(left: Path, right: Path) -> None:
    names = sorted(p.name for p in left.iterdir())
    assert names == sorted(p.name for p in right.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    for name in names:
        assert (left / name).read_bytes() == (right / name).read_bytes(), name


def test_write_llama_is_byte_identical_to_the_factory_build(tmp_path: Path, tiny_model_dir: Path) -> None:
    _same_files(write_llama(tmp_path / "direct"), tiny_model_dir)


def _cpu_seconds(who: int) -> float:
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


def test_the_embedded_model_is_built_in_this_process_on_first_use(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XINSERVE_CACHE_DIR", str(tmp_path))
    settings = ModelSettings(name="tiny", path="embedded:xinserve-tiny")
    children, own = _cpu_seconds(resource.RUSAGE_CHILDREN), _cpu_seconds(resource.RUSAGE_SELF)
    path = resolve_model_path(settings)
    # No child process (a spawned builder re-imported torch and transformers: ~10 CPU s), and cheap
    # here: this process had torch and transformers' tokenizers loaded already.
    assert _cpu_seconds(resource.RUSAGE_CHILDREN) == children
    assert _cpu_seconds(resource.RUSAGE_SELF) - own < 5
    assert path == str(tmp_path / "xinserve-tiny")
    _same_files(Path(path), tiny_model_dir)
    assert [p.name for p in tmp_path.iterdir()] == ["xinserve-tiny"]  # no staging directory left behind
    assert resolve_model_path(settings) == path  # reused
