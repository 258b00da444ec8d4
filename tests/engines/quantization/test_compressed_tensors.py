"""compressed-tensors checkpoints, written with the library's own compressors (so its packing, not
ours, defines the layout) and dequantized with its own decompressors for the oracle:

- W8A8 int, per-channel weights, per-token dynamic activations (the llm-compressor default);
- W8A8 int, per-tensor asymmetric weights with static asymmetric activations, and an ``ignore`` list;
- FP8 weights per channel with dynamic per-token FP8 activations;
- Qwen3-MoE with per-module config groups: int8 attention (W8A16) and packed int4 groups with zero
  points (W4A16, ``weight_shape``) everywhere else, per-expert records, the router left in floats.

Weight-only checkpoints must give transformers' greedy tokens on the dequantized weights. Where
activations are quantized, transformers runs with the same activation quantization hooked into each
quantized Linear, and the engine's greedy choices must cost at most ``REGRET`` nats of log-prob at
each step: both sides compute the same quantized math in float32 and differ only in summation order,
which can move a token's activation across an int8 / FP8 rounding edge and its logits by ~1e-3, so a
different choice can only happen on a near-tie.
"""

import re
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
from compressed_tensors.quantization.utils import calculate_qparams

from tests.engines.quantization.checkpoints import greedy_regret, hf_greedy, write_quantized
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.model_loader import load_model
from xinserve.engines.quantization.experts import QuantExperts
from xinserve.engines.quantization.linear import QuantLinear
from xinserve.kernels.quantized_weight import QuantizedWeight

PROMPTS = [[1, 17, 42, 99, 7, 250], [1, 5, 300, 12]]
MAX_TOKENS = 8
REGRET = 2e-2
STATIC_INPUT = (0.03, 3)  # the "calibrated" static activation scale and zero point


def args(**kwargs) -> QuantizationArgs:
    return QuantizationArgs(**kwargs)


INT8_CHANNEL = args(num_bits=8, type="int", symmetric=True, strategy="channel")
PER_TOKEN_INT8 = args(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
SCHEMES = {
    "w8a8_dynamic": ("int-quantized", {"group_0": QuantizationScheme(
        targets=["Linear"], weights=INT8_CHANNEL, input_activations=PER_TOKEN_INT8)}, ["lm_head"]),
    "w8a8_static": ("int-quantized", {"group_0": QuantizationScheme(
        targets=["Linear"], weights=args(num_bits=8, type="int", symmetric=False, strategy="tensor"),
        input_activations=args(num_bits=8, type="int", symmetric=False, strategy="tensor", dynamic=False))},
        ["lm_head", "re:.*layers[.]1[.]mlp[.]down_proj$"]),
    "fp8_dynamic": ("float-quantized", {"group_0": QuantizationScheme(
        targets=["Linear"], weights=args(num_bits=8, type="float", symmetric=True, strategy="channel"),
        input_activations=args(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True))},
        ["lm_head"]),
    "moe_w4a16": ("pack-quantized", {
        "attention": QuantizationScheme(targets=["re:.*self_attn.*"], weights=INT8_CHANNEL, format="int-quantized"),
        "rest": QuantizationScheme(targets=["Linear"], format="pack-quantized", weights=args(
            num_bits=4, type="int", symmetric=False, strategy="group", group_size=16))},
        ["lm_head", "re:.*mlp[.]gate$"]),
}


def _group(name: str, groups: dict[str, QuantizationScheme]) -> QuantizationScheme:
    for scheme in groups.values():
        if any(t.startswith("re:") and re.match(t[3:], name) for t in scheme.targets):
            return scheme
    return next(s for s in groups.values() if "Linear" in s.targets)


def _ignored(name: str, ignore: list[str]) -> bool:
    return any(re.match(t[3:], name) if t.startswith("re:") else name == t for t in ignore)


def _min_max(weight: torch.Tensor, weights: QuantizationArgs) -> tuple[torch.Tensor, torch.Tensor]:
    if weights.strategy == "group":
        grouped = weight.view(weight.shape[0], -1, weights.group_size)
        return grouped.amin(-1), grouped.amax(-1)
    if weights.strategy == "channel":
        return weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    return weight.amin().reshape(1), weight.amax().reshape(1)


def quantizer(fmt: str, groups: dict[str, QuantizationScheme], ignore: list[str]):
    def quantize(name: str, weight: torch.Tensor):
        module = name.removesuffix(".weight")
        if _ignored(module, ignore):
            return None
        scheme = _group(module, groups)
        scale, zero = calculate_qparams(*_min_max(weight, scheme.weights), scheme.weights)
        compressor = BaseCompressor.load_from_registry(scheme.format or fmt)
        stored = compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero}, scheme)
        dequantized = compressor.decompress(dict(stored), scheme)["weight"]
        act = scheme.input_activations
        if act is None:
            return stored, None, dequantized
        kind = f"{'int8' if act.type == 'int' else 'fp8'}_{'per_token' if act.dynamic else 'static'}"
        static = {}
        if not act.dynamic:
            stored["input_scale"] = torch.tensor([STATIC_INPUT[0]])
            stored["input_zero_point"] = torch.tensor([STATIC_INPUT[1]], dtype=torch.int8)
            static = {"input_scale": torch.tensor(STATIC_INPUT[0]), "input_offset": torch.tensor(float(STATIC_INPUT[1]))}
        record = QuantizedWeight(torch.zeros(1, 1, dtype=torch.int8), 8, torch.ones(1, 1), (1, 1), 1, 1,
                                 activation=kind, **static)
        return stored, record, dequantized

    return quantize


@pytest.fixture(scope="module")
def checkpoints(tiny_models, tmp_path_factory) -> dict[str, tuple[Path, Path, dict]]:
    out = {}
    for case, (fmt, groups, ignore) in SCHEMES.items():
        root = tmp_path_factory.mktemp(f"ct-{case}")
        config = QuantizationConfig(config_groups=groups, format=fmt, quantization_status="compressed",
                                    ignore=ignore).model_dump(mode="json", exclude_none=True)
        source = tiny_models("qwen3_moe") if case.startswith("moe") else tiny_models("llama")
        activations = write_quantized(source, root / "ct", root / "oracle", quantizer(fmt, groups, ignore), config)
        out[case] = (root / "ct", root / "oracle", activations)
    return out


def engine_greedy(path: Path) -> list[list[int]]:
    with LLM(model=str(path), num_kv_blocks=64, max_model_len=256) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]


@pytest.mark.parametrize("case", ["w8a8_dynamic", "w8a8_static", "fp8_dynamic"])
def test_activation_quantized_checkpoints_choose_what_transformers_would(checkpoints, case: str) -> None:
    path, oracle, activations = checkpoints[case]
    assert activations, "the scheme quantizes activations"
    for prompt, tokens in zip(PROMPTS, engine_greedy(path)):
        assert len(tokens) == MAX_TOKENS or tokens[-1] == 2
        assert greedy_regret(oracle, prompt, tokens, activations) <= REGRET


def test_ignored_modules_stay_float_and_static_activations_keep_their_zero_point(checkpoints) -> None:
    model, _ = load_model(str(checkpoints["w8a8_static"][0]), None, torch.device("cpu"))
    assert isinstance(model.model.layers[1].mlp.down_proj, torch.nn.Linear)  # in the ignore list
    gate_up = model.model.layers[1].mlp.gate_up_proj
    assert isinstance(gate_up, QuantLinear) and gate_up.weights[0].input_offset == STATIC_INPUT[1]
    # per-tensor weights: q (64 rows) keeps its own record; k and v (32 rows each, 32-row "blocks")
    # concatenate into one record whose two-block grid keeps each one's scale and zero point
    q, kv = model.model.layers[0].self_attn.qkv_proj.weights
    assert q.scale.shape == (1, 1) and kv.scale.shape == (2, 1) and kv.zero.shape == (2, 1)


def test_moe_w4a16_with_per_module_groups_equals_transformers(checkpoints) -> None:
    path, oracle, activations = checkpoints["moe_w4a16"]
    assert not activations
    model, _ = load_model(str(path), None, torch.device("cpu"))
    layer = model.model.layers[1]
    assert layer.self_attn.qkv_proj.weights[0].bits == 8 and isinstance(layer.mlp.experts, QuantExperts)
    experts = layer.mlp.experts.weights[0]
    assert experts.bits == 4 and experts.qweight.shape == (8, 64, 32) and experts.zero is not None
    assert layer.mlp.gate.weight.dtype == torch.float32
    assert engine_greedy(path) == [hf_greedy(oracle, prompt, MAX_TOKENS) for prompt in PROMPTS]
