"""How a pooling model's directory is read (engines/pooling/model_spec.py): the runner and task it
implies, sentence-transformers' pooling in both config spellings, Matryoshka and the score tokens."""

import json
from pathlib import Path

import pytest

from xinserve.engines.pooling.model_spec import read_pooler_spec, resolve_runner
from xinserve.engines.pooling.params import PoolingParams


def _model(path: Path, architecture: str, modules: list | None = None, **config) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"architectures": [architecture], "hidden_size": 64, **config}))
    if modules is not None:
        (path / "modules.json").write_text(json.dumps(modules))
    return str(path)


def _pooling_module(path: Path, config: dict) -> dict:
    (path / "1_Pooling").mkdir(parents=True, exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    return {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}


def test_auto_runner_follows_the_directory(tmp_path):
    assert resolve_runner(_model(tmp_path / "lm", "Qwen3ForCausalLM"), "auto", None) == ("generate", None)
    assert resolve_runner(_model(tmp_path / "st", "Qwen3ForCausalLM", []), "auto", None) == ("pooling", "embed")
    assert resolve_runner(_model(tmp_path / "bare", "Qwen3Model"), "auto", None) == ("pooling", "embed")
    classifier = _model(tmp_path / "cls", "Qwen3ForSequenceClassification")
    assert resolve_runner(classifier, "auto", None) == ("pooling", "classify")
    assert resolve_runner(str(tmp_path / "lm"), "pooling", "classify") == ("pooling", "classify")
    with pytest.raises(ValueError, match="no LM head to generate with"):
        resolve_runner(classifier, "generate", None)


@pytest.mark.parametrize(("config", "method"), [
    ({"pooling_mode": "mean"}, "mean"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "cls"),  # sentence-transformers < 6
    ({"pooling_mode_lasttoken": True}, "lasttoken"),
])
def test_sentence_transformers_pooling_and_normalize(tmp_path, config, method):
    modules = [_pooling_module(tmp_path, config)]
    spec = read_pooler_spec(_model(tmp_path, "Qwen3Model", modules), "embed", None)
    assert (spec.method, spec.normalize, spec.reads_every_row) == (method, False, method != "lasttoken")
    modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    assert read_pooler_spec(_model(tmp_path, "Qwen3Model", modules), "embed", None).normalize


def test_unsupported_pooling_is_refused_by_name(tmp_path):
    modules = [_pooling_module(tmp_path, {"pooling_mode": "max"})]
    with pytest.raises(ValueError, match="'max' is not supported"):
        read_pooler_spec(_model(tmp_path, "Qwen3Model", modules), "embed", None)
    modules = [_pooling_module(tmp_path, {"pooling_mode": "mean", "include_prompt": False})]
    with pytest.raises(ValueError, match="include_prompt false is not supported"):
        read_pooler_spec(_model(tmp_path, "Qwen3Model", modules), "embed", None)
    modules = [{"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"}]
    with pytest.raises(ValueError, match="'sentence_transformers.models.Dense' is not supported"):
        read_pooler_spec(_model(tmp_path, "Qwen3Model", modules), "embed", None)


def test_without_sentence_transformers_config_a_decoder_pools_its_last_token_normalized(tmp_path):
    spec = read_pooler_spec(_model(tmp_path, "Qwen3ForCausalLM"), "embed", None)
    assert (spec.method, spec.normalize, spec.matryoshka_dimensions) == ("lasttoken", True, None)


def test_matryoshka_declarations(tmp_path):
    any_size = read_pooler_spec(_model(tmp_path / "a", "Qwen3Model", is_matryoshka=True), "embed", None)
    any_size.check(PoolingParams(dimensions=7))
    with pytest.raises(ValueError, match="at most the model's hidden size 64"):
        any_size.check(PoolingParams(dimensions=65))
    listed = read_pooler_spec(_model(tmp_path / "b", "Qwen3Model", matryoshka_dimensions=[8, 32]), "embed", None)
    listed.check(PoolingParams(dimensions=32))
    with pytest.raises(ValueError, match=r"supports dimensions \[8, 32\], got 16"):
        listed.check(PoolingParams(dimensions=16))


def test_score_tokens(tmp_path):
    lm = _model(tmp_path, "Qwen3ForCausalLM")
    assert read_pooler_spec(lm, "classify", "no,yes").score_tokens == ("no", "yes")
    with pytest.raises(ValueError, match="needs classifier_from_token"):
        read_pooler_spec(lm, "classify", None)
    with pytest.raises(ValueError, match="two tokens false,true"):
        read_pooler_spec(lm, "classify", "yes")
