"""``speculative_config`` as vLLM spells it, from every entry point: LLM keyword, YAML, --speculative-config."""

import argparse

import pytest

from xinserve.engines.config import EngineConfig
from xinserve.engines.speculative.config import SpeculativeConfig, parse_speculative_config
from xinserve.server.cli.main import _add_serve_args, build_config
from xinserve.server.config import ConfigError, parse_config


def test_an_ngram_config_is_parsed_with_vllm_defaults_for_the_missing_bound():
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}) == \
        SpeculativeConfig("ngram", 3, prompt_lookup_min=5, prompt_lookup_max=5)
    got = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                    "prompt_lookup_max": 4, "disable_by_batch_size": 4})
    assert (got.prompt_lookup_min, got.prompt_lookup_max, got.disable_by_batch_size) == (2, 4, 4)


@pytest.mark.parametrize("method", ["mtp", "deepseek_mtp", "glm4_moe_mtp"])
def test_mtp_and_vllm_aliases_of_it_are_parsed(method):
    assert parse_speculative_config({"method": method, "num_speculative_tokens": 2}) == SpeculativeConfig("mtp", 2)


@pytest.mark.parametrize(("value", "message"), [
    ({"method": "medusa", "num_speculative_tokens": 3}, "method must be one of ngram"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "'eagle' (EAGLE heads) is not supported yet"),
    ({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "are the ngram method's"),
    ({"model": "/m", "num_speculative_tokens": 3}, "'draft_model' (a separate draft model) is not supported yet"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be in [1, 16], got 0"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     "prompt_lookup_min 5 is more than prompt_lookup_max 2"),
    ({"method": "ngram", "num_speculative_tokens": 3, "draft_tokens": 2}, "unknown key(s) draft_tokens"),
    ("ngram", "must be a mapping"),
])
def test_bad_configs_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=None) as info:
        parse_speculative_config(value)
    assert message in str(info.value)
    with pytest.raises(ValueError) as info:
        EngineConfig(model="m", speculative_config=value)
    assert message in str(info.value)


def test_yaml_refuses_a_bad_config_at_load_with_the_key_path():
    data = {"models": [{"name": "m", "path": "/m", "speculative_config": {"method": "mtp2", "num_speculative_tokens": 1}}]}
    with pytest.raises(ConfigError, match=r"models\.0\.speculative_config: .*method must be one of ngram"):
        parse_config(data, "test.yaml")
    good = {"models": [{"name": "m", "path": "/m", "speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}]}
    assert parse_config(good, "test.yaml").models[0].engine_kwargs()["speculative_config"] == \
        {"method": "ngram", "num_speculative_tokens": 2}


def test_the_serve_flag_takes_vllm_json():
    parser = argparse.ArgumentParser()
    _add_serve_args(parser)
    args = parser.parse_args(["--model", "/m", "--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}'])
    assert build_config(args, env={}).models[0].speculative_config == \
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "/m", "--speculative-config", "ngram"])
