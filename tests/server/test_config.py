"""YAML config validation (errors name the bad key) and the serve flags built on top of it."""

import argparse
from pathlib import Path

import pytest

from xinserve.server.cli.main import _add_serve_args, build_config
from xinserve.server.config import ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[2]


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _add_serve_args(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize("name", ["default", "ascend", "musa", "hybrid"])
def test_shipped_configs_are_valid(name):
    config = load_config(REPO / "config" / f"{name}.yaml")
    assert config.models


def test_default_config_is_the_embedded_tiny_model():
    config = load_config(REPO / "config" / "default.yaml")
    (model,) = config.models
    assert (model.name, model.path, model.workers, model.is_embedded) == (
        "xinserve-tiny", "embedded:xinserve-tiny", ["cpu"], True)


def test_hybrid_mixes_devices():
    config = load_config(REPO / "config" / "hybrid.yaml")
    assert {w.split(":")[0] for w in config.models[0].workers} == {"npu", "musa"}
    assert config.models[0].fallback == ["qwen2.5-7b"]


@pytest.mark.parametrize(("data", "needle"), [
    ({"models": [{"name": "a", "path": "/m", "wokers": ["cpu"]}]}, "models.0.wokers"),
    ({"models": [{"name": "a", "path": "/m", "workers": ["tpu:0"]}]}, "models.0.workers"),
    ({"models": [{"name": "a", "path": "/m", "dtype": "fp8"}]}, "models.0.dtype"),
    ({"models": [{"name": "a", "path": "/m", "max_num_seqs": 0}]}, "models.0.max_num_seqs"),
    ({"models": [{"name": "a", "path": "/m"}], "server": {"prot": 1}}, "server.prot"),
    ({"models": [{"name": "a", "path": "/m"}], "monitoring": {"metrics": "maybe"}}, "monitoring.metrics"),
    ({"models": [{"name": "a", "path": "/m"}], "metrics": {"prefix": "vllm:"}}, "metrics.prefix"),
    ({"models": [{"name": "a", "path": "/m"}], "limits": {"max_body_byts": 1}}, "limits.max_body_byts"),
    ({"models": [{"name": "a", "path": "/m"}], "limits": {"max_n": 0}}, "limits.max_n"),
    ({"models": [{"name": "a"}]}, "models.0.path"),
    ({"models": []}, "models"),
    ({"models": [{"name": "a", "path": "/m", "fallback": ["b"]}]}, "models.0.fallback"),
    ({"models": [{"name": "a", "path": "/m", "fallback": ["a"]}]}, "models.0.fallback"),
    ({"models": [{"name": "a", "path": "/m"}, {"name": "a", "path": "/n"}]}, "duplicate"),
])
def test_errors_name_the_bad_key(data, needle):
    with pytest.raises(ConfigError) as info:
        parse_config(data, "test.yaml")
    assert needle in str(info.value)
    assert "test.yaml" in str(info.value)


def test_worker_specs_are_normalised():
    config = parse_config({"models": [{"name": "a", "path": "/m", "workers": ["NPU", "cuda:1", " cpu "]}]})
    assert config.models[0].workers == ["npu:0", "cuda:1", "cpu"]


def test_yaml_errors_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(listy)


def test_no_arguments_serve_the_embedded_default():
    config = build_config(args(), env={})
    assert [m.name for m in config.models] == ["xinserve-tiny"]
    assert config.server.api_keys == []


def test_model_flags(tmp_path):
    config = build_config(args("--model", str(tmp_path), "--device", "cpu,cpu", "--device", "npu:1",
                               "--served-model-name", "mine", "--max-model-len", "512", "--api-key", "k1",
                               "--port", "9000", "--no-enable-prefix-caching"), env={"XINSERVE_API_KEY": "k2"})
    (model,) = config.models
    assert (model.name, model.workers, model.max_model_len, model.enable_prefix_caching) == (
        "mine", ["cpu", "cpu", "npu:1"], 512, False)
    assert config.server.port == 9000
    assert config.server.api_keys == ["k1", "k2"]
    assert build_config(args("--model", "/data/glm-4-9b"), env={}).models[0].name == "glm-4-9b"


def test_trust_request_chat_template_is_off_unless_asked():
    assert build_config(args(), env={}).server.trust_request_chat_template is False
    assert build_config(args("--trust-request-chat-template"), env={}).server.trust_request_chat_template is True


def test_metric_prefix_flag_overrides_the_config():
    assert build_config(args(), env={}).metrics.prefix == "xinserve"
    hybrid = str(REPO / "config" / "hybrid.yaml")
    config = build_config(args("--config", hybrid, "--metric-prefix", "vllm"), env={})
    assert (config.metrics.prefix, config.monitoring.metrics) == ("vllm", True)


def test_engine_flags_override_every_model_of_a_config():
    config = build_config(args("--config", str(REPO / "config" / "hybrid.yaml"), "--max-num-seqs", "8"), env={})
    assert [m.max_num_seqs for m in config.models] == [8, 8]
    assert config.models[0].max_model_len == 8192  # untouched


def test_conflicting_flags():
    with pytest.raises(ConfigError, match="either --config or --model"):
        build_config(args("--config", "x.yaml", "--model", "/m"), env={})
    with pytest.raises(ConfigError, match="need --model"):
        build_config(args("--device", "npu:0"), env={})


def test_reasoning_parser_flag_and_setting():
    config = build_config(args("--model", "/data/qwen3", "--reasoning-parser", "qwen3"), env={})
    assert config.models[0].reasoning_parser == "qwen3"
    assert build_config(args("--model", "/data/qwen3"), env={}).models[0].reasoning_parser is None
    with pytest.raises(ConfigError, match="reasoning_parser"):
        parse_config({"models": [{"name": "m", "path": "/m", "reasoning_parser": "o1"}]})
