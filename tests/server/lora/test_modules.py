"""``--lora-modules`` and the ``lora_modules`` key: both spellings, which model gets which adapter, and the
start-up checks that stop a server whose adapter could never serve (a clear message, exit 2)."""

import argparse
import json
from pathlib import Path

import pytest
import yaml

from tests.server.test_config import args
from xinserve.server.cli.main import build_config, main
from xinserve.server.config import ConfigError, parse_config
from xinserve.server.lora.modules import LoraModule, for_model, parse_lora_module


def adapter_dir(root: Path, name: str) -> str:
    """A directory that passes the start-up check (the engine checks its weights when it loads it)."""
    path = root / name
    path.mkdir()
    (path / "adapter_config.json").write_text("{}")
    return str(path)


def test_both_spellings_of_a_module():
    assert parse_lora_module("sql=/a/b=c") == LoraModule("sql", "/a/b=c")
    text = json.dumps({"name": "sql", "path": "/a", "base_model_name": "m"})
    assert parse_lora_module(text) == LoraModule("sql", "/a", "m")


@pytest.mark.parametrize("text", ["sql", "=/a", "sql=", '{"name": "sql"}', '{"name": "", "path": "/a"}',
                                  '{"name": "sql", "path": "/a", "rank": 8}', '{"name": "sql", "path": "/a"',
                                  '["sql", "/a"]', '{"name": "sql", "path": "/a", "base_model_name": 3}'])
def test_a_malformed_module_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_lora_module(text)


def test_a_malformed_module_flag_exits_like_any_bad_flag():
    with pytest.raises(SystemExit):
        args("--model", "/m", "--lora-modules", "sql")


def test_the_flag_takes_several_values_and_repeats(tmp_path):
    a, b, c = (adapter_dir(tmp_path, n) for n in "abc")
    config = build_config(args("--model", "/m", "--enable-lora", "--lora-modules", f"a={a}",
                               json.dumps({"name": "b", "path": b}), "--lora-modules", f"c={c}"), env={})
    assert config.models[0].lora_modules == {"a": a, "b": b, "c": c}
    assert config.models[0].engine_kwargs()["lora_modules"] == {"a": a, "b": b, "c": c}


def test_base_model_name_picks_the_model_of_a_config(tmp_path):
    a, b = adapter_dir(tmp_path, "a"), adapter_dir(tmp_path, "b")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"models": [
        {"name": "m1", "path": "/m", "enable_lora": True, "lora_modules": {"kept": a}},
        {"name": "m2", "path": "/m", "enable_lora": True}]}))
    config = build_config(args("--config", str(path), "--lora-modules",
                               json.dumps({"name": "only-m2", "path": b, "base_model_name": "m2"})), env={})
    assert config.model("m1").lora_modules == {"kept": a}  # the file's adapters stay, the flag's go to m2
    assert config.model("m2").lora_modules == {"only-m2": b}


def test_a_base_model_name_that_is_no_served_model_stops_the_start(tmp_path):
    a = adapter_dir(tmp_path, "a")
    with pytest.raises(ConfigError, match="base_model_name 'm9', which is not a served model"):
        build_config(args("--model", "/m", "--enable-lora", "--lora-modules",
                          json.dumps({"name": "a", "path": a, "base_model_name": "m9"})), env={})


def test_a_name_given_twice_is_refused():
    modules = [LoraModule("a", "/x"), LoraModule("a", "/y")]
    with pytest.raises(ValueError, match="'a' is given twice"):
        for_model(modules, "m", ["m"])


def test_a_flag_adapter_without_base_goes_to_every_model():
    modules = [LoraModule("a", "/x"), LoraModule("b", "/y", "m2")]
    assert for_model(modules, "m1", ["m1", "m2"]) == {"a": "/x"}
    assert for_model(modules, "m2", ["m1", "m2"]) == {"a": "/x", "b": "/y"}


def one_model(tmp_path: Path, **model) -> dict:
    return {"models": [{"name": "tiny", "path": "/m", "enable_lora": True, **model}]}


def test_an_adapter_named_like_a_served_model_stops_the_start(tmp_path):
    with pytest.raises(ConfigError, match="lora_modules.tiny: the adapter's name is a served model's name"):
        parse_config(one_model(tmp_path, lora_modules={"tiny": adapter_dir(tmp_path, "a")}))


def test_an_adapter_on_two_models_stops_the_start(tmp_path):
    a = adapter_dir(tmp_path, "a")
    data = {"models": [{"name": m, "path": "/m", "enable_lora": True, "lora_modules": {"sql": a}} for m in ("x", "y")]}
    with pytest.raises(ConfigError, match="models.1.lora_modules.sql: adapter name 'sql' is also an adapter of model x"):
        parse_config(data)


@pytest.mark.parametrize(("make", "message"), [
    (lambda root: str(root / "missing"), "does not exist"),
    (lambda root: str(root), "has no adapter_config.json"),
])
def test_an_adapter_path_that_is_no_adapter_stops_the_start(tmp_path, make, message):
    with pytest.raises(ConfigError, match=f"models.0.lora_modules.sql: .*{message}"):
        parse_config(one_model(tmp_path, lora_modules={"sql": make(tmp_path)}))


def test_adapters_need_enable_lora(tmp_path):
    data = {"models": [{"name": "tiny", "path": "/m", "lora_modules": {"sql": adapter_dir(tmp_path, "a")}}]}
    with pytest.raises(ConfigError, match="LoRA adapters need enable_lora"):
        parse_config(data)


def test_serve_exits_2_naming_the_bad_adapter(tmp_path, capsys):
    code = main(["serve", "--model", "/m", "--enable-lora", "--lora-modules", f"sql={tmp_path / 'nope'}"])
    assert code == 2
    assert f"lora_modules.sql: directory {tmp_path / 'nope'} does not exist" in capsys.readouterr().err
