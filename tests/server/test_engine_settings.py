"""Every engine setting is defined once (``xinserve.engines.EngineConfig``): each is a per-model YAML key and a
``serve`` flag with the same default, help text and bounds, and a value round-trips from the flag
through the YAML config into the engine's config. These tests keep the lists from drifting apart."""

import json
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
import yaml

from tests.server.test_config import args
from xinserve.engines import EngineConfig
from xinserve.server.cli.main import MODEL_FLAGS, build_config
from xinserve.server.config import ConfigError, parse_config
from xinserve.server.engine_settings import PER_WORKER, PLACED
from xinserve.server.model_settings import ModelSettings

ENGINE_FIELDS = {f.name: f for f in fields(EngineConfig)}


def _kind(name: str) -> Any:
    annotation = ModelSettings.model_fields[name].annotation
    return next((a for a in get_args(annotation) if a is not type(None)), annotation)


# A non-default value for each setting given as a JSON object on the command line.
JSON_SETTINGS = {
    "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5599"},
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
    "kv_transfer_config": {"kv_connector": "MooncakeConnector", "kv_role": "kv_consumer", "kv_port": 15000},
}


def _adapter_dir() -> str:
    """A directory that passes the start-up check of a LoRA adapter (its adapter_config.json)."""
    path = Path(tempfile.mkdtemp(prefix="lora-"))
    (path / "adapter_config.json").write_text("{}")
    return str(path)


def sample(name: str) -> tuple[Any, list[str]]:
    """A value other than the default for setting ``name``, and the flag arguments that give it."""
    flag, kind = "--" + name.replace("_", "-"), _kind(name)
    if name == "lora_modules":  # an adapter's directory, on a model with LoRA on: checked at start
        path = _adapter_dir()
        return {"sql": path}, ["--enable-lora", flag, f"sql={path}"]
    if kind is bool:
        value = not ModelSettings.model_fields[name].default
        return value, [flag if value else f"--no-{flag[2:]}"]
    if get_origin(kind) is Literal:
        value = get_args(kind)[-1]
    elif get_origin(kind) is dict and get_args(kind) != (str, str):  # a structured setting: JSON
        value = JSON_SETTINGS[name]
        return value, [flag, json.dumps(value)]
    elif get_origin(kind) is dict:
        return {"rms_norm": "reference", "decode_attention": "reference"}, [
            flag, "rms_norm=reference,decode_attention=reference"]
    else:
        value = {int: 3, float: 0.5, str: "/elsewhere"}[kind]
    return value, [flag, str(value)]


def test_every_engine_setting_is_a_yaml_key_and_a_flag_with_its_default_and_help():
    settings = set(ENGINE_FIELDS) - set(PLACED)
    assert settings <= set(ModelSettings.model_fields) and settings <= set(MODEL_FLAGS)
    for name in settings:
        info, field = ModelSettings.model_fields[name], ENGINE_FIELDS[name]
        assert (info.default, info.description) == (field.default, field.metadata["help"]), name
    # The fields the server places itself: ``path`` is the model, ``workers`` the devices, a group the ranks.
    assert set(PLACED) <= set(ENGINE_FIELDS) and not set(PLACED) & set(ModelSettings.model_fields)
    config = build_config(args("--model", "/m", "--device", "npu:1"), env={})
    assert (config.models[0].path, config.models[0].workers) == ("/m", ["npu:1"])


@pytest.mark.parametrize("name", MODEL_FLAGS)
def test_a_setting_round_trips_from_flag_to_yaml_to_engine(name):
    value, argv = sample(name)
    assert value != ModelSettings.model_fields[name].default
    config = build_config(args("--model", "/m", *argv), env={})
    assert getattr(config.models[0], name) == value
    reread = parse_config(yaml.safe_load(yaml.safe_dump(config.model_dump())))
    assert getattr(reread.models[0], name) == value
    kwargs = reread.models[0].engine_kwargs()
    if name in ENGINE_FIELDS and name not in PER_WORKER:
        assert getattr(EngineConfig(model="/m", **kwargs), name) == value
    else:
        assert name not in kwargs


def bad_value(meta: dict[str, Any]) -> Any:
    if "choices" in meta or "check" in meta:  # a structured setting refuses a string too
        return "nonesuch"
    return meta["le"] + 1 if "le" in meta else meta["ge"] - 1


@pytest.mark.parametrize("name", [n for n, f in ENGINE_FIELDS.items()
                                  if n not in PLACED and set(f.metadata) - {"help"}])
def test_the_yaml_key_and_the_engine_refuse_the_same_values(name):
    bad = bad_value(ENGINE_FIELDS[name].metadata)
    with pytest.raises(ConfigError, match=f"models.0.{name}"):
        parse_config({"models": [{"name": "m", "path": "/m", name: bad}]})
    with pytest.raises(ValueError, match=f"{name} must be"):
        EngineConfig(model="/m", **{name: bad})


@pytest.mark.parametrize("text", ["rms_norm", "=reference", "rms_norm=", ","])
def test_a_malformed_kernels_flag_is_refused(text):
    with pytest.raises(SystemExit):
        args("--kernels", text)
