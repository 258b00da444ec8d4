"""How the loader meets quantization: a scheme no format implements is refused by name (never read as
floats), ``quantization`` forces a scheme or refuses a mismatch (tensor, expert and pipeline parallel over
quantized weights: test_quantized_parallel.py), and a float checkpoint is quantized on the fly (``w8a8``: int8 weights
with per-channel scales, per-token int8 activations) with its weights kept in int8, reported in
bytes, and computing what transformers computes with the same quantization (greedy regret bound as
in test_compressed_tensors.py)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.engines.quantization.checkpoints import greedy_regret, write_quantized
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.config import EngineConfig
from xinserve.engines.model_loader import load_model
from xinserve.engines.quantization.install import weights_report
from xinserve.engines.quantization.linear import QuantLinear
from xinserve.engines.quantization.online import quantize_weight
from xinserve.kernels.quantized_weight import dequantize

CPU = torch.device("cpu")
REGRET = 2e-2
PROMPTS = [[1, 17, 42, 99, 7, 250], [1, 5, 300, 12]]


def with_quantization_config(src: Path, dst: Path, settings: dict) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": settings}))
    return dst


def test_a_quant_method_no_format_implements_is_refused_by_name(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = with_quantization_config(tiny_model_dir, tmp_path / "m", {"quant_method": "bitsandbytes", "bits": 4})
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes', which is not implemented"):
        load_model(str(path), None, CPU)


def test_a_forced_scheme_that_the_checkpoint_does_not_have_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    fp8 = with_quantization_config(tiny_model_dir, tmp_path / "m", {"quant_method": "fp8", "weight_block_size": [8, 8]})
    with pytest.raises(ValueError, match="'compressed-tensors' was asked for, but .* is quantized as 'fp8'"):
        load_model(str(fp8), None, CPU, quantization="compressed-tensors")
    with pytest.raises(ValueError, match="needs a checkpoint quantized as 'compressed-tensors'.*float weights"):
        load_model(str(tiny_model_dir), None, CPU, quantization="compressed-tensors")


def test_unknown_quantization_option_is_refused_by_the_engine_config() -> None:
    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="int3")


def test_the_quantization_option_names_every_format_and_on_the_fly_scheme() -> None:
    from xinserve.engines.config import QUANTIZATION_METHODS
    from xinserve.engines.quantization.formats import FORMATS
    from xinserve.engines.quantization.online import SCHEMES

    assert sorted(QUANTIZATION_METHODS) == sorted({*FORMATS, *SCHEMES})


@pytest.fixture(scope="module")
def w8a8(tiny_models, tmp_path_factory) -> tuple[Path, Path, dict]:
    root = tmp_path_factory.mktemp("w8a8")

    def quantize(name: str, weight: torch.Tensor):
        record = quantize_weight(weight, "w8a8")
        return {"weight": weight}, record, dequantize(record)

    activations = write_quantized(tiny_models("llama"), root / "float", root / "oracle", quantize, None)
    return root / "float", root / "oracle", activations


def test_on_the_fly_w8a8_keeps_int8_weights_and_leaves_embeddings_norms_and_lm_head_float(w8a8) -> None:
    float_model, _ = load_model(str(w8a8[0]), None, CPU)
    model, _ = load_model(str(w8a8[0]), None, CPU, quantization="w8a8")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.weights[0].qweight.dtype == torch.int8
    assert qkv.weights[0].scale.shape == (qkv.out_features, 1)  # one scale per output channel
    assert model.lm_head.weight.dtype == torch.float32 and model.model.norm.weight.dtype == torch.float32
    report, dense = weights_report(model), weights_report(float_model)
    assert report["quantized_schemes"] == ["int8 1x192 int8_per_token", "int8 1x64 int8_per_token"]
    projections = dense["bytes"] - report["float_bytes"]  # the float32 projections the int8 ones replace
    # int8 values (1/4 of float32) plus one float32 scale per output channel
    assert projections / 4 < report["quantized_bytes"] < projections / 3.5


def test_on_the_fly_w8a8_chooses_what_transformers_would_with_the_same_quantization(w8a8) -> None:
    path, oracle, activations = w8a8
    with LLM(model=str(path), quantization="w8a8", num_kv_blocks=64, max_model_len=256) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
        assert llm.engine.runner.kernels.chosen["quant_linear"] in ("int8mm", "dequant", "reference")
    for prompt, out in zip(PROMPTS, outs):
        assert greedy_regret(oracle, prompt, out.token_ids, activations) <= REGRET


def test_quantized_weights_of_a_layer_the_model_skips_are_skipped_too(tiny_models, tmp_path: Path) -> None:
    """GLM-4.5 checkpoints carry a multi-token-prediction layer past num_hidden_layers; its q/k/v biases
    load into the quantized fused projection shard by shard."""
    path = shutil.copytree(tiny_models("glm4_moe"), tmp_path / "glm")
    weights = load_file(path / "model.safetensors")
    weights["model.layers.2.self_attn.q_proj.weight"] = torch.randn(64, 64)  # quantized on the fly, then skipped
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    model, _ = load_model(str(path), None, CPU, quantization="w8a8")
    assert len(model.model.layers) == 2 and isinstance(model.model.layers[1].self_attn.qkv_proj, QuantLinear)
