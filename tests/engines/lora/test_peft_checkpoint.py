"""What a PEFT adapter directory may hold: each refusal is a ValueError naming what cannot be served
(the server answers it with a 400)."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engines.lora.conftest import edit_config, make_adapter
from xinserve.engines.lora.peft_checkpoint import read_adapter
from xinserve.engines.lora.targets import ModelTargets
from xinserve.engines.model_loader import load_model


@pytest.fixture(scope="module")
def llama_targets(tiny_models) -> ModelTargets:
    model, _ = load_model(str(tiny_models("llama")), torch.float32, torch.device("cpu"))
    return ModelTargets.of(model)


@pytest.fixture
def adapter_copy(adapters, tmp_path):
    """A fresh copy of a rank-8 Llama adapter to edit."""
    return shutil.copytree(adapters("llama", 8), tmp_path / "adapter")


def test_scaling_is_folded_into_b_with_alpha_pattern_and_rslora(adapter_copy, llama_targets):
    edit_config(adapter_copy, lora_alpha=16, alpha_pattern={"v_proj": 4}, use_rslora=True)
    raw = load_file(str(adapter_copy / "adapter_model.safetensors"))
    adapter = read_adapter(str(adapter_copy), llama_targets, max_lora_rank=8)
    for module, scale in (("layers.0.self_attn.q_proj", 16 / 8**0.5), ("layers.1.self_attn.v_proj", 4 / 8**0.5)):
        b = raw[f"base_model.model.model.{module}.lora_B.weight"]
        torch.testing.assert_close(adapter.modules[module][1], b * scale)
    assert adapter.rank == 8 and len(adapter.modules) == 7 * 2


@pytest.mark.parametrize(("changes", "message"), [
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "trained biases"),
    ({"target_modules": ["q_proj", "lm_head"]}, "lm_head are not served"),
    ({"target_parameters": ["mlp.gate.weight"]}, "target_parameters .mlp.gate.weight. is not served"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
])
def test_unserved_settings_are_refused_by_name(adapter_copy, llama_targets, changes, message):
    edit_config(adapter_copy, **changes)
    with pytest.raises(ValueError, match=message):
        read_adapter(str(adapter_copy), llama_targets, max_lora_rank=16)


def test_rank_above_max_lora_rank_and_missing_files_are_refused(adapter_copy, llama_targets, tmp_path):
    with pytest.raises(ValueError, match="rank 8, more than max_lora_rank 4"):
        read_adapter(str(adapter_copy), llama_targets, max_lora_rank=4)
    with pytest.raises(ValueError, match="adapter_config.json not found"):
        read_adapter(str(tmp_path / "nowhere"), llama_targets, max_lora_rank=16)
    (adapter_copy / "adapter_model.safetensors").unlink()
    with pytest.raises(ValueError, match="adapter_model.safetensors not found"):
        read_adapter(str(adapter_copy), llama_targets, max_lora_rank=16)


def test_weights_the_model_cannot_take_are_refused(adapter_copy, llama_targets, tiny_models, tmp_path):
    weights = adapter_copy / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    embed = {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)}
    save_file({**tensors, **embed}, str(weights))
    with pytest.raises(ValueError, match="embed_tokens.lora_embedding_A' is not served"):
        read_adapter(str(adapter_copy), llama_targets, max_lora_rank=16)
    save_file({k: v for k, v in tensors.items() if "q_proj.lora_B" not in k}, str(weights))
    with pytest.raises(ValueError, match="q_proj has lora_A but not its pair"):
        read_adapter(str(adapter_copy), llama_targets, max_lora_rank=16)
    # an adapter trained on a base of another width
    wide = make_adapter(tiny_models("llama", intermediate_size=96), tmp_path / "wide", 4)
    with pytest.raises(ValueError, match="trained on another base model"):
        read_adapter(str(wide), llama_targets, max_lora_rank=16)


def test_mixture_of_experts_layers_serve_attention_and_refuse_expert_targets(tiny_models, adapters, tmp_path):
    model, _ = load_model(str(tiny_models("qwen3_moe")), torch.float32, torch.device("cpu"))
    targets = ModelTargets.of(model)
    attention = adapters("qwen3_moe", 4, targets=["q_proj", "k_proj", "v_proj", "o_proj"])
    assert len(read_adapter(str(attention), targets, max_lora_rank=8).modules) == 4 * model.num_layers
    experts = shutil.copytree(attention, tmp_path / "experts")
    tensors = load_file(str(experts / "adapter_model.safetensors"))
    moe_layer = min(set(range(model.num_layers)) - targets.dense_layers)
    for half, shape in (("A", (4, 64)), ("B", (32, 4))):
        tensors[f"base_model.model.model.layers.{moe_layer}.mlp.experts.0.gate_proj.lora_{half}.weight"] = \
            torch.zeros(shape)
    save_file(tensors, str(experts / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=rf"layers.{moe_layer}.mlp.experts.0.gate_proj is a mixture-of-experts"):
        read_adapter(str(experts), targets, max_lora_rank=8)


def test_mla_models_are_refused_by_name(tiny_models):
    model, _ = load_model(str(tiny_models("deepseek_v3")), torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="not supported on DeepseekV3ForCausalLM yet"):
        ModelTargets.of(model)
