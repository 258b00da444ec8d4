"""Loading the checkpoint's MTP layer (engines/models/mtp.py): with MTP on it is loaded, shaped as the
checkpoint says, and holds one more KV layer; off, its weights are skipped; a config or checkpoint
without one, and layouts it does not support yet, are refused by name."""

import json

import pytest
import torch

from xinserve.engines.model_loader import load_model


@pytest.mark.parametrize(("arch", "extra_kv_values"), [
    ("deepseek_v3", 32 + 8),  # one more latent: kv_lora_rank + qk_rope_head_dim
    ("glm_moe_dsa", 32 + 8 + 16),  # ... and its indexer's keys (index_head_dim)
    ("glm4_moe", 2 * 2 * 16),  # one more dense layer: key and value, 2 KV heads of 16
])
def test_the_mtp_layer_loads_with_its_own_kv_layer_and_is_skipped_when_off(tiny_models, arch, extra_kv_values):
    path = tiny_models(arch, mtp=True)
    off, _ = load_model(str(path), torch.float32, "cpu")
    on, _ = load_model(str(path), torch.float32, "cpu", mtp=True)
    assert off.mtp is None
    assert on.kv_bytes_per_token(torch.float32) - off.kv_bytes_per_token(torch.float32) == 4 * extra_kv_values
    assert type(on.mtp.block.mlp).__name__ == "SparseMoeBlock"  # layer N >= first_k_dense_replace
    # the target's embedding and head are shared: the checkpoint has none of its own
    assert on.mtp.embed_tokens is None and on.mtp.shared_head.head is None
    own = tiny_models(arch, mtp=True, mtp_own_head=True)
    loaded, _ = load_model(str(own), torch.float32, "cpu", mtp=True)
    assert loaded.mtp.embed_tokens is not None and loaded.mtp.shared_head.head is not None


def test_a_model_without_an_mtp_layer_is_refused_by_name(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="num_nextn_predict_layers >= 1"):
        load_model(str(tiny_models("llama")), torch.float32, "cpu", mtp=True)
    with pytest.raises(ValueError, match=r"MTP layer's weights \(model.layers.3.eh_proj.weight"):
        load_model(str(tiny_models("deepseek_v3")), torch.float32, "cpu", mtp=True)  # config says 1, no weights
    path = tiny_models("glm4_moe", mtp=True)
    config = json.loads((path / "config.json").read_text())
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((path / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="needs num_nextn_predict_layers >= 1 in config.json; this model has 0"):
        load_model(str(tmp_path), torch.float32, "cpu", mtp=True)


def test_mtp_under_pipeline_parallel_is_refused_by_name_with_the_reason(tiny_models):
    from xinserve.engines.parallel.pipeline_parallel import PipelineStage, StageLayout

    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM at .*'mtp' is not implemented with pipeline "
                                         r"parallel: the MTP layer needs the last stage's final hidden state"):
        load_model(str(tiny_models("deepseek_v3", mtp=True)), torch.float32, "cpu",
                   pipeline=PipelineStage(None, StageLayout.of(1, 1, 2)), mtp=True)
