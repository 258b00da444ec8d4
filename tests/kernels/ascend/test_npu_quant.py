"""The Ascend quantized-op candidates (kernels/ascend/quant.py) through the fake torch_npu: each scheme
equals the reference formula of kernels/quantized_weight.py on the same inputs, within the registry's
tolerance, and the fake refuses what the real operators' dtype rules refuse."""

from dataclasses import replace
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

from tests.engines.quantization.modelslim_checkpoints import write_w8a8_dynamic
from xinserve.engines import LLM, SamplingParams
from xinserve.engines.platforms.npu import KERNEL_PREFERENCE as NPU_KERNELS
from xinserve.kernels import registry
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.checks import TOLERANCE, max_error
from xinserve.kernels.quantized_weight import (
    QuantizedWeight,
    QuantShape,
    dequantize,
    pack_int4,
    quantize_activation,
)
from xinserve.kernels.references import dense as reference
from xinserve.kernels.routing import MoeRouting

HALF = [torch.float16, torch.bfloat16]


@pytest.fixture
def no_forced_kernels(monkeypatch) -> None:
    monkeypatch.delenv(registry.ENV_VAR, raising=False)


@pytest.fixture(scope="module")
def quant(npu) -> ModuleType:
    import xinserve.kernels.ascend.quant

    return xinserve.kernels.ascend.quant


def _record(out_features: int, in_features: int, bits: int, activation: str, group: int | None = None,
            asymmetric: bool = False, seed: int = 0) -> QuantizedWeight:
    """Seeded values; scales spread over a factor 4 between groups (a mis-applied one shows), sized so
    x @ W.T stays of order one for x of order one. The static input scale is not a round number: the
    operator rounds x / s + o where the reference rounds x / s and adds o, so they part at exact ties
    (x / s = k + 1/2 with an odd offset), which a round scale makes common for float16 x (1.125 / 0.03
    is 37.5 in float32)."""
    generator = torch.Generator().manual_seed(seed)
    bound = 8 if bits == 4 else 128
    values = torch.randint(-bound, bound, (out_features, in_features), generator=generator)
    group = group or in_features
    grid = (out_features, -(-in_features // group))
    scale = (0.5 + 1.5 * torch.rand(grid, generator=generator)) / (bound / 2 * in_features**0.5)
    zero = torch.randint(-2, 3, grid, generator=generator).float() if asymmetric else None
    static = activation == "int8_static"
    return QuantizedWeight(pack_int4(values) if bits == 4 else values.to(torch.int8), bits, scale, (1, group),
                           in_features, out_features, zero=zero, activation=activation,
                           input_scale=torch.tensor(0.0297) if static else None,
                           input_offset=torch.tensor(3.0) if static else None)


def _reference(x: torch.Tensor, weight: QuantizedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(quantize_activation(x.float(), weight), dequantize(weight), bias)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("scheme", ["w8a8_static", "w8a8_dynamic", "w8a16", "w4a16_groups"])
def test_quant_linear_equals_the_reference(quant, scheme: str, dtype: torch.dtype) -> None:
    weight = {
        "w8a8_static": lambda: _record(48, 72, 8, "int8_static"),
        "w8a8_dynamic": lambda: _record(48, 72, 8, "int8_per_token"),
        "w8a16": lambda: _record(40, 72, 8, "none", asymmetric=True),
        "w4a16_groups": lambda: _record(32, 96, 4, "none", group=32, asymmetric=True),
    }[scheme]()
    generator = torch.Generator().manual_seed(1)
    bias = torch.randn(weight.out_features, generator=generator).to(dtype)
    prepared = quant.prepare_quant_weight(weight, dtype)
    for tokens in (1, 7, 33):
        x = torch.randn(tokens, weight.in_features, generator=generator).to(dtype)
        got = quant.quant_linear(x, prepared, bias)
        assert got.dtype == dtype and got.shape == (tokens, weight.out_features)
        error = max_error(got, _reference(x, weight, bias.float()))
        assert error <= TOLERANCE[dtype], f"{scheme}: max abs err {error:.2e}"


def test_static_offsets_need_the_int32_correction(quant) -> None:
    """Without the offset's correction in the int32 bias the result is off by o_x * row sums: the test
    sees a wrong one."""
    weight = _record(16, 64, 8, "int8_static")
    x = torch.randn(5, 64).half()
    prepared = quant.prepare_quant_weight(weight, torch.float16)
    wrong = type(prepared)(**{**{f: getattr(prepared, f) for f in prepared.__slots__},
                              "correction": torch.zeros(16, dtype=torch.int32)})
    assert max_error(quant.quant_linear(x, wrong, None), _reference(x, weight, None)) > 1e-1
    assert max_error(quant.quant_linear(x, prepared, None), _reference(x, weight, None)) <= TOLERANCE[torch.float16]


@pytest.mark.parametrize("dtype", HALF)
def test_int8_experts_equal_the_reference(quant, dtype: torch.dtype) -> None:
    experts, hidden_size, inter = 4, 64, 32
    w13 = _record(experts * 2 * inter, hidden_size, 8, "int8_per_token", seed=2)
    w2 = _record(experts * hidden_size, inter, 8, "int8_per_token", seed=3)

    def stack(w: QuantizedWeight, rows: int) -> QuantizedWeight:
        return QuantizedWeight(w.qweight.view(experts, rows, -1), 8, w.scale.view(experts, rows, 1),
                               (1, w.in_features), w.in_features, rows, activation="int8_per_token")

    w13, w2 = stack(w13, 2 * inter), stack(w2, hidden_size)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(7, hidden_size, generator=generator).to(dtype)
    ids = torch.tensor([[0, 1], [1, 3], [0, 3], [1, 0], [3, 1], [0, 1], [1, 3]], dtype=torch.int32)  # 2 idle
    weights = torch.rand(7, 2, generator=generator)
    got = quant.quant_fused_moe(hidden, quant.prepare_quant_experts(w13, w2, dtype), weights, ids)
    # reference: each (token, expert) row's input quantized per row, the SwiGLU output likewise; the
    # roundings to the compute dtype where the operators round (each matmul's output, the SwiGLU, the
    # routing weights), since a rounding there can move an int8 step of the next quantization
    want = torch.zeros(7, hidden_size)
    gate_up_all, down_all = dequantize(w13), dequantize(w2)
    for token in range(7):
        for slot in range(2):
            expert = int(ids[token, slot])
            gate_up = F.linear(quantize_activation(hidden[token:token + 1].float(), w13), gate_up_all[expert])
            act = reference.silu_and_mul(gate_up.to(dtype)).float()
            down = F.linear(quantize_activation(act, w2), down_all[expert]).to(dtype).float()
            want[token] += weights[token, slot].to(dtype).float() * down[0]
    assert max_error(got, want) <= TOLERANCE[dtype]


def test_the_fake_refuses_what_the_operators_refuse(npu) -> None:
    fake = npu.torch_npu
    x1, x2 = torch.ones(2, 8, dtype=torch.int8), torch.ones(8, 4, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="scale dtype"):  # float16 output takes an int64 / float32 scale
        fake.npu_quant_matmul(x1, x2, torch.ones(4, dtype=torch.bfloat16), output_dtype=torch.float16)
    with pytest.raises(RuntimeError, match="output_dtype"):
        fake.npu_quant_matmul(x1, x2, torch.ones(4), output_dtype=torch.float32)
    with pytest.raises(RuntimeError, match="float16 / bfloat16"):
        fake.npu_dynamic_quant(torch.ones(2, 8))
    with pytest.raises(RuntimeError, match="antiquant_group_size"):
        fake.npu_weight_quant_batchmatmul(torch.ones(2, 64).half(), torch.ones(64, 4, dtype=torch.int8),
                                          torch.ones(4, 4).half(), antiquant_group_size=16)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        fake.npu_convert_weight_to_int4pack(torch.zeros(4, 12, dtype=torch.int32))
    # the int64 scale of a float16 output is the float32's bits
    scale = torch.tensor([0.125, 3.0])
    assert torch.equal(fake.npu_trans_quant_param(scale).to(torch.int32).view(torch.float32), scale)


def _shapes(*quant: QuantShape) -> ModelShapes:
    return ModelShapes(num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=16, rope_is_neox=True, hidden_size=64,
                       intermediate_size=96, vocab_size=128, block_size=128, quant_shapes=quant)


def test_the_registry_takes_the_npu_candidates_for_the_schemes_they_implement(npu, no_forced_kernels) -> None:
    # float16: in bfloat16 the probe's outputs (order 5 with the bias) sit at the tolerance for every
    # candidate, the CPU dequant one included (one bfloat16 ulp there is 3e-2)
    dtype = torch.float16
    shapes = _shapes(QuantShape("int8", (1, 64), "int8_static", False, 96, 64),
                     QuantShape("int8", (1, 96), "int8_per_token", False, 64, 96),
                     QuantShape("int4", (1, 32), "none", True, 64, 96),
                     QuantShape("int8", (1, 64), "int8_per_token", False, 64, 64, experts=4),
                     QuantShape("int8", (1, 32), "int8_per_token", False, 64, 32, experts=4))
    shapes = replace(shapes, num_experts=4, moe_intermediate_size=32,
                     moe_routing=MoeRouting(top_k=2, scoring="softmax", renormalize=True))
    selection = registry.select(NPU_KERNELS, torch.device("cpu"), dtype, shapes)
    assert selection.chosen["quant_linear"] == "npu", selection.rejected.get("quant_linear")
    # The experts' probe compares with the float32 reference, where a half-precision rounding of the
    # SwiGLU output can move its int8 step (the CPU dequant candidate misses the tolerance the same way):
    # the npu candidate must at least run through the fake's operators (test_int8_experts_equal_the_reference
    # checks its values against the reference in the compute dtype).
    if selection.chosen["quant_fused_moe"] != "npu":
        assert dict(selection.rejected["quant_fused_moe"])["npu"].startswith("max abs err")


@pytest.mark.parametrize(("shape", "reason"), [
    (QuantShape("fp8", (128, 128), "none", False, 64, 96), "fp8"),
    (QuantShape("int8", (64, 96), "int8_static", True, 64, 96), "block"),
    (QuantShape("int4", (1, 16), "none", False, 64, 96), "multiple of 32"),
    (QuantShape("int4", (1, 96), "int8_per_token", False, 64, 96), "int4 weights with int8_per_token"),
])
def test_schemes_the_operators_cannot_take_keep_the_reference(npu, no_forced_kernels, shape: QuantShape,
                                                              reason: str) -> None:
    selection = registry.select(NPU_KERNELS, torch.device("cpu"), torch.float16, _shapes(shape))
    assert selection.chosen["quant_linear"] != "npu"
    assert reason in dict(selection.rejected["quant_linear"])["npu"]


def test_float32_and_int4_experts_are_declined(quant) -> None:
    dense = _shapes(QuantShape("int8", (1, 96), "int8_per_token", False, 64, 96))
    assert "float16 / bfloat16" in quant.quant_limits("quant_linear", dense, torch.float32)
    experts = _shapes(QuantShape("int4", (1, 64), "int8_per_token", False, 64, 64, experts=4))
    assert "int4 experts" in quant.quant_limits("quant_fused_moe", experts, torch.bfloat16)


def test_msmodelslim_w8a8_dynamic_generation_on_npu_equals_cpu(npu_platform, tiny_models, tmp_path) -> None:
    """A W8A8_DYNAMIC checkpoint served on the npu path (npu_dynamic_quant + npu_quant_matmul on the
    fake) gives the CPU reference path's greedy tokens (float16 on both)."""
    path = write_w8a8_dynamic(Path(tiny_models("llama")), tmp_path / "w8a8_dynamic")
    options = {"dtype": "float16", "block_size": 128, "num_kv_blocks": 4}
    prompts = [[1, 17, 230, 45, 9, 300, 2, 77], [1, 600, 3, 3, 81, 402, 77, 12, 5]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(str(path), device="npu:0", **options) as on_npu:
        assert on_npu.engine.runner.kernels.chosen["quant_linear"] == "npu"
        got = [r.token_ids for r in on_npu.generate(prompts, params)]
    with LLM(str(path), device="cpu", **options, kernels={"quant_linear": "reference", "prefill_attention": "reference"}) as on_cpu:
        want = [r.token_ids for r in on_cpu.generate(prompts, params)]
    assert got == want
