"""Block FP8 checkpoints (DeepSeek-V3's layout: e4m3 weights, one float32 ``weight_scale_inv`` per
block) load with their weights kept in FP8 and generate transformers' greedy tokens on the
dequantized weights: a dense Llama whose shapes leave partial row and column blocks (gate/up rows
end mid-block, so those shards stay separate records), and DeepSeek-V3 with MLA (its 40-row
``kv_a_proj_with_mqa`` is 1.25 blocks, like the real 576-row one's 4.5) and per-expert FP8 experts."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engines.quantization.checkpoints import fp8_blocks, hf_greedy, write_quantized
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.model_loader import load_model
from xinserve.engines.quantization.experts import QuantExperts
from xinserve.engines.quantization.linear import QuantLinear

BLOCK = (32, 32)
CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
PROMPTS = [[1, 17, 42, 99, 7, 250], [1, 5, 300, 12]]
MAX_TOKENS = 8


fp8_block = fp8_blocks(BLOCK)


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    out = {}
    for arch, kwargs in (("llama", {"intermediate_size": 200}), ("deepseek_v3", {})):
        root = tmp_path_factory.mktemp(f"fp8-{arch}")
        write_quantized(tiny_models(arch, **kwargs), root / "fp8", root / "oracle", fp8_block, CONFIG)
        out[arch] = (root / "fp8", root / "oracle")
    return out


def engine_greedy(path: Path, **options) -> list[list[int]]:
    with LLM(model=str(path), num_kv_blocks=64, max_model_len=256, **options) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    return [out.token_ids for out in outs]


def test_block_fp8_llama_keeps_fp8_weights_and_splits_shards_that_end_mid_block(checkpoints) -> None:
    model, _ = load_model(str(checkpoints["llama"][0]), None, torch.device("cpu"))
    layer = model.model.layers[0]
    qkv, gate_up = layer.self_attn.qkv_proj, layer.mlp.gate_up_proj
    assert isinstance(qkv, QuantLinear) and isinstance(gate_up, QuantLinear)
    assert len(qkv.weights) == 1 and qkv.weights[0].qweight.shape == (128, 64)  # q 64 + k 32 + v 32 rows
    assert qkv.weights[0].qweight.dtype == torch.float8_e4m3fn and qkv.weights[0].scale.shape == (4, 2)
    assert [w.out_features for w in gate_up.weights] == [200, 200]  # 200 rows = 6.25 blocks: not merged
    assert layer.mlp.down_proj.weights[0].scale.shape == (2, 7)  # 200 columns: a partial column block
    assert model.lm_head.weight.dtype == torch.float32 and model.model.embed_tokens.weight.dtype == torch.float32


def test_block_fp8_llama_greedy_equals_transformers_on_the_dequantized_weights(checkpoints) -> None:
    path, oracle = checkpoints["llama"]
    got = engine_greedy(path, kernels={"quant_linear": "reference"})
    assert got == [hf_greedy(oracle, prompt, MAX_TOKENS) for prompt in PROMPTS]


def test_block_fp8_deepseek_v3_with_fp8_experts_equals_transformers(checkpoints) -> None:
    path, oracle = checkpoints["deepseek_v3"]
    model, _ = load_model(str(path), None, torch.device("cpu"))
    attention = model.model.layers[1].self_attn
    assert isinstance(model.model.layers[1].mlp.experts, QuantExperts)
    assert attention.kv_a_proj_with_mqa.weights[0].scale.shape == (2, 2)  # 40 rows: 1.25 blocks
    assert attention.kv_b_proj.weight.dtype == torch.float32  # read by the absorbed attention: dequantized
    assert engine_greedy(path) == [hf_greedy(oracle, prompt, MAX_TOKENS) for prompt in PROMPTS]


def test_a_scale_grid_that_does_not_cover_the_weight_is_refused(checkpoints, tmp_path: Path) -> None:
    path = checkpoints["llama"][0]
    for item in path.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    weights = load_file(path / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight_scale_inv"
    weights[name] = weights[name][:, :6].contiguous()  # the partial last column block's scales dropped
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weight_scale_inv of shape \(2, 6\) for a 64 x 200 weight"):
        load_model(str(tmp_path), None, torch.device("cpu"))
