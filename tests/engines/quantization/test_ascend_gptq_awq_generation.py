"""End to end: a checkpoint in msModelSlim, GPTQ or AWQ form served by the engine (weights kept
quantized, computed by the quant kernels) against transformers in float32 running the same model with
the weights its stored tensors stand for (tests/engines/quantization/hf_oracle.py).

Weight-only schemes (GPTQ, AWQ): the engine only dequantizes, so greedy tokens equal the oracle's.
Schemes that quantize activations (msModelSlim W8A8 static, W8A8_DYNAMIC, W4A8_DYNAMIC experts): both
sides compute the same quantized formulas, but a different float32 summation order can move one
activation across an int8 rounding boundary, moving a logit by about one activation step times a
weight column (~1e-3 at these sizes); where two candidates are that close the greedy choice may
differ. So the bound is per step, teacher-forced on the engine's tokens: the engine's token is at most
REGRET_NATS below the oracle's best. A mis-applied scale, offset or bias costs whole nats.
"""

from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.engines.quantization.hf_oracle import QuantOracle, activation
from tests.engines.quantization.int4_checkpoints import write_int4_model
from tests.engines.quantization.modelslim_checkpoints import (  # noqa: F401  (fixture)
    msmodelslim_w8a8,
    write_w4a8_moe,
    write_w8a8_dynamic,
)
from xinserve.engines import LLM, SamplingParams

MAX_TOKENS = 8
PROMPTS = [[1, 17, 230, 45, 9], [1, 600, 3, 3, 81, 402, 77, 12, 5]]
REGRET_NATS = 0.05


def _generate(path: Path) -> list[list[int]]:
    with LLM(str(path), num_kv_blocks=32, block_size=4) as llm:
        results = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return [r.token_ids for r in results]


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_weight_only_int4_greedy_tokens_equal_the_oracle(method: str, tiny_models, tmp_path: Path) -> None:
    model_dir = Path(tiny_models("llama"))
    path, dequantized = write_int4_model(model_dir, tmp_path / method, method)
    oracle = QuantOracle(model_dir, tmp_path / "oracle", dequantized, {})
    for prompt, tokens in zip(PROMPTS, _generate(path), strict=True):
        assert tokens == oracle.greedy(prompt, MAX_TOKENS)


def _check_regret(path: Path, oracle: QuantOracle) -> None:
    for prompt, tokens in zip(PROMPTS, _generate(path), strict=True):
        assert len(tokens) == MAX_TOKENS
        worst = max(oracle.regrets(prompt, tokens))
        assert worst <= REGRET_NATS, f"{prompt}: a step {worst:.3f} nats below the oracle's best"


def test_msmodelslim_w8a8_static_export(msmodelslim_w8a8, tiny_models, tmp_path: Path) -> None:  # noqa: F811
    stored = load_file(str(next(msmodelslim_w8a8.glob("quant_model_weight*.safetensors"))))
    modules = [n.removesuffix(".deq_scale") for n in stored if n.endswith(".deq_scale")]
    dequantized = {f"{m}.weight": stored[f"{m}.weight"].float() * stored[f"{m}.weight_scale"] for m in modules}
    activations = {m: activation("int8_static", stored[f"{m}.input_scale"], stored[f"{m}.input_offset"])
                   for m in modules}
    _check_regret(msmodelslim_w8a8, QuantOracle(Path(tiny_models("llama")), tmp_path, dequantized, activations))


def test_msmodelslim_w8a8_dynamic(tiny_models, tmp_path: Path) -> None:
    model_dir = Path(tiny_models("llama"))
    path = write_w8a8_dynamic(model_dir, tmp_path / "w8a8_dynamic")
    stored = load_file(str(next(path.glob("quant_model_weight*.safetensors"))))
    modules = [n.removesuffix(".weight_scale") for n in stored if n.endswith(".weight_scale")]
    dequantized = {f"{m}.weight": stored[f"{m}.weight"].float() * stored[f"{m}.weight_scale"] for m in modules}
    per_token = activation("int8_per_token")
    _check_regret(path, QuantOracle(model_dir, tmp_path / "oracle", dequantized, dict.fromkeys(modules, per_token)))


def test_qwen3_moe_with_w4a8_dynamic_experts(tiny_models, tmp_path: Path) -> None:
    model_dir = Path(tiny_models("qwen3_moe"))
    path, dequantized = write_w4a8_moe(model_dir, tmp_path / "w4a8")
    per_token = activation("int8_per_token")
    quantized_modules = {name.removesuffix(".weight") for name in dequantized if ".experts." not in name}
    quantized_modules |= {name.split(".experts.")[0] + ".experts" for name in dequantized if ".experts." in name}
    oracle = QuantOracle(model_dir, tmp_path / "oracle", dequantized, dict.fromkeys(quantized_modules, per_token))
    _check_regret(path, oracle)
