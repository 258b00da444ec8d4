"""The capacity planner (engines/core/capacity.py): parameter counts of GLM-5 and DeepSeek-V3 within 1% of
transformers' meta-device count from config.json alone; a started engine's pool and weights are what
the plan says; quantized bytes keep embeddings, LM head and norms unquantized; plans that do not fit
say why, naming the model and the shape."""

import math

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, DeepseekV3Config, GlmMoeDsaConfig

import xinserve.engines.platforms.cpu
from xinserve.engines import LLM
from xinserve.engines.core.capacity import GIB, Layout, plan, quantized_bytes


@pytest.fixture(scope="module")
def glm5(tmp_path_factory) -> str:
    """A directory holding only GLM-5's config.json (transformers' defaults: 78 layers, 256 experts)."""
    path = tmp_path_factory.mktemp("glm5")
    GlmMoeDsaConfig(architectures=["GlmMoeDsaForCausalLM"], dtype="bfloat16").save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("dsv3")
    DeepseekV3Config(architectures=["DeepseekV3ForCausalLM"], dtype="bfloat16").save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("model", ["glm5", "deepseek_v3"])
def test_parameter_counts_are_transformers_meta_count_from_config_alone(request, model):
    path = request.getfixturevalue(model)
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    expected = sum(p.numel() for p in reference.parameters())
    assert plan(path).parameters == pytest.approx(expected, rel=0.01)


def test_a_started_engine_holds_the_planned_weights_and_pool(tiny_models, monkeypatch):
    """With the free memory after the warm-up pinned to F bytes, the engine's pool is the plan's on a
    card of F + the planned weight bytes: same KV bytes per token, same blocks, same sequences."""
    path = str(tiny_models("glm_moe_dsa"))  # the latent and the indexer keys per token
    block_size, max_model_len, fraction = 4, 64, 0.5
    planned = plan(path, device_memory_gib=1.0, block_size=block_size, max_model_len=max_model_len,
                   kv_cache_memory_fraction=fraction)
    free = 2 * 101 * block_size * planned.kv_bytes_per_token_per_device  # 100 blocks after the scratch one
    monkeypatch.setattr(xinserve.engines.platforms.cpu, "host_available_bytes", lambda: free)
    llm = LLM(path, block_size=block_size, max_model_len=max_model_len, max_num_seqs=8,
              kv_cache_memory_fraction=fraction)
    runner = llm.engine.runner
    loaded = list(runner.model.parameters())
    assert planned.parameters == sum(p.numel() for p in loaded)
    assert planned.weight_bytes_per_device == sum(p.numel() * p.element_size() for p in loaded)
    assert planned.kv_bytes_per_token_per_device * block_size == runner.bytes_per_block()
    card = plan(path, device_memory_gib=(free + planned.weight_bytes_per_device) / GIB, block_size=block_size,
                max_model_len=max_model_len, kv_cache_memory_fraction=fraction)
    assert llm.engine.block_manager.num_blocks == 100
    assert card.max_sequences == 100 // (max_model_len // block_size) and card.fits


def test_quantized_bytes_keep_embeddings_lm_head_and_norms_unquantized(tiny_models):
    path = str(tiny_models("llama"))  # float32, untied, 2 layers
    cfg = AutoConfig.from_pretrained(path)
    hidden, inter, vocab, layers = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * cfg.head_dim
    linears = [(cfg.num_attention_heads * cfg.head_dim + 2 * kv, hidden), (hidden, hidden), (2 * inter, hidden),
               (hidden, inter)]
    unquantized = 4 * (2 * vocab * hidden + (2 * layers + 1) * hidden)  # embed, lm_head, norms in float32
    for scheme in ("fp8", "w8a8", "w4a8", "w4a16"):
        expected = unquantized + layers * sum(quantized_bytes(torch.Size(s), scheme) for s in linears)
        assert plan(path, quantization=scheme).weight_bytes_per_device == expected, scheme
    # one [300, 200] weight: 1 byte each + a float32 scale per 128 x 128 block, per row, per 128 inputs
    assert quantized_bytes(torch.Size([300, 200]), "fp8") == 60000 + 4 * 3 * 2
    assert quantized_bytes(torch.Size([300, 200]), "w8a8") == 60000 + 4 * 300
    assert quantized_bytes(torch.Size([8, 300, 200]), "w4a16") == 8 * (30000 + 4 * 300 * 2)


def test_glm5_fits_or_says_why(glm5):
    """bf16 on 8 x 64 GiB: the weights do not fit; W4A8 on 16 x 64 GiB at TP 16 fits one full-length
    sequence (the latent is replicated, so TP does not shrink the KV per token; PP does); W8A8 there
    fits no full-length sequence, but does at 32k."""
    bf16 = plan(glm5, devices=8, layout=Layout(tp=8))
    assert not bf16.fits and bf16.max_sequences == 0
    assert bf16.reason.startswith("model GlmMoeDsaForCausalLM at")
    assert "the weights need 176.9 GiB per device, more than 64 GiB" in bf16.reason
    w4a8 = plan(glm5, devices=16, layout=Layout(tp=16), quantization="w4a8")
    assert w4a8.fits and w4a8.reason is None and w4a8.max_sequences >= 1
    # the latents and indexer keys of 78 layers in bf16, whatever the TP size
    assert w4a8.kv_bytes_per_token_per_device == 2 * (78 * (512 + 64) + 78 * 128)
    assert plan(glm5, devices=16, layout=Layout(tp=8, pp=2)).kv_bytes_per_token_per_device == 78 * (576 + 128)
    w8a8 = plan(glm5, devices=16, layout=Layout(tp=16), quantization="w8a8")
    assert not w8a8.fits and "holds less than one sequence of 202752 tokens" in w8a8.reason
    assert plan(glm5, devices=16, layout=Layout(tp=16), quantization="w8a8", max_model_len=32768).fits


def test_layouts_that_do_not_divide_name_the_model_and_the_shape(tiny_models):
    path = str(tiny_models("deepseek_v3"))  # 4 heads, 8 routed experts, 3 layers
    odd = plan(path, devices=6, layout=Layout(tp=3, ep=True))
    assert not odd.fits and odd.reason.startswith("model DeepseekV3ForCausalLM at")
    assert "4 attention heads do not divide by 3" in odd.reason
    assert "8 routed experts do not divide over 3 expert-parallel ranks" in odd.reason
    assert "pipeline_parallel_size 4 is more than its 3 layers" in plan(path, layout=Layout(pp=4)).reason
    assert "6 devices do not make whole replicas of 4 x 1" in plan(path, devices=6, layout=Layout(tp=4)).reason
    assert plan(path, devices=4, layout=Layout(tp=2, pp=2), device_memory_gib=1).fits


def test_expert_parallel_holds_whole_experts(glm5):
    """E / tp whole experts per rank (16 of 256 at TP 16): on GLM-5's shapes, the same bytes as a 1/16
    slice of every expert, scales included (whole 128-groups and blocks either way)."""
    tp = plan(glm5, devices=16, layout=Layout(tp=16), quantization="w4a8")
    ep = plan(glm5, devices=16, layout=Layout(tp=16, ep=True), quantization="w4a8")
    assert ep.weight_bytes_per_device == tp.weight_bytes_per_device
    assert math.isclose(ep.parameters, tp.parameters)
