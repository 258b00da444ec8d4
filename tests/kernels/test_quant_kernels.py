"""The quant_linear / quant_fused_moe ops: the reference computes the layout's formula, every candidate
equals the reference on the same inputs, and the registry probes candidates on the model's quantized
shapes, keeps the ones that agree and says why it rejected the others."""

from dataclasses import replace

import pytest
import torch

from xinserve.engines.platforms.cpu import KERNEL_PREFERENCE as CPU_KERNELS
from xinserve.kernels import quant_dequant, quant_int8
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.inputs import max_error
from xinserve.kernels.probes.quant import random_weight
from xinserve.kernels.quantized_weight import (
    QuantShape,
    dequantize,
    expand_grid,
    quantize_activation,
    unpack_int4,
)
from xinserve.kernels.references import quant as quant_reference
from xinserve.kernels.registry import select

SHAPES = [
    QuantShape("int8", (1, 48), "int8_per_token", False, 40, 48),  # W8A8 per channel
    QuantShape("int8", (1, 48), "none", False, 40, 48),  # W8A16
    QuantShape("fp8", (16, 16), "none", False, 40, 48),  # block FP8, a partial row block (40 = 2.5 x 16)
    QuantShape("int4", (1, 16), "none", True, 40, 50),  # W4A16 groups, zero points, a partial group
    QuantShape("int8", (40, 48), "int8_static", True, 40, 48),  # per-tensor, static asymmetric activation
    QuantShape("fp8", (40, 48), "fp8_static", False, 40, 48),
    QuantShape("fp8", (1, 48), "fp8_per_token", False, 40, 48),
]


def model_shapes(*quant: QuantShape) -> ModelShapes:
    return ModelShapes(num_heads=4, num_kv_heads=2, head_dim=16, rotary_dim=16, rope_is_neox=True,
                       hidden_size=64, intermediate_size=96, vocab_size=128, block_size=16, quant_shapes=quant)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s.qtype}-{s.block}-{s.activation}")
def test_reference_quant_linear_is_the_layouts_formula(shape: QuantShape) -> None:
    gen = torch.Generator().manual_seed(1)
    weight = random_weight(shape, gen)
    x, bias = torch.randn(5, weight.in_features, generator=gen), torch.randn(weight.out_features, generator=gen)
    got = quant_reference.quant_linear(x, quant_reference.prepare_quant_weight(weight, torch.float32), bias)
    # W[r, c] = (q - zero) * scale, each of the block holding (r, c)
    rows, cols = weight.out_features, weight.in_features
    q = unpack_int4(weight.qweight, cols).float() if shape.qtype == "int4" else weight.qweight.float()
    zero = 0 if weight.zero is None else expand_grid(weight.zero, weight.block, rows, cols)
    w = (q - zero) * expand_grid(weight.scale, weight.block, rows, cols)
    assert torch.allclose(got, quantize_activation(x, weight) @ w.T + bias, atol=1e-5)


@pytest.mark.parametrize("module", [quant_dequant, quant_int8], ids=["dequant", "int8mm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_candidates_equal_the_reference(module, dtype: torch.dtype) -> None:
    shapes = [s for s in SHAPES if not getattr(module, "unsupported", lambda *a: None)(
        "quant_linear", model_shapes(s), dtype)]
    assert shapes, "every candidate supports some scheme"
    gen = torch.Generator().manual_seed(2)
    for shape in shapes:
        weight = random_weight(shape, gen)
        bias = torch.randn(weight.out_features, generator=gen)
        prepared = module.prepare_quant_weight(weight, dtype)
        for tokens in (1, 7, 33):
            x = torch.randn(tokens, weight.in_features, generator=gen)
            want = quant_reference.quant_linear(x.to(dtype).float(), weight, bias)
            got = module.quant_linear(x.to(dtype), prepared, bias.to(dtype))
            assert max_error(got, want) < (2e-3 if dtype == torch.float32 else 5e-2), shape


def test_int8mm_keeps_int8_and_rejects_other_schemes_by_name() -> None:
    w8a8 = SHAPES[0]
    assert quant_int8.unsupported("quant_linear", model_shapes(w8a8), torch.float32) is None
    prepared = quant_int8.prepare_quant_weight(random_weight(w8a8, torch.Generator()), torch.float32)
    assert prepared.qweight.dtype == torch.int8
    reason = quant_int8.unsupported("quant_linear", model_shapes(w8a8, SHAPES[2]), torch.float32)
    assert reason is not None and "fp8" in reason


def test_quantized_fused_moe_candidates_equal_the_reference_and_dequantize_per_expert() -> None:
    gen = torch.Generator().manual_seed(3)
    w13 = random_weight(QuantShape("int8", (1, 24), "int8_per_token", False, 32, 24, experts=4), gen)
    w2 = random_weight(QuantShape("int8", (1, 16), "int8_per_token", False, 24, 16, experts=4), gen)
    hidden = torch.randn(6, 24, generator=gen)
    ids = torch.tensor([[0, 1], [1, 3], [3, 0], [0, 1], [1, 0], [3, 1]])  # expert 2 gets no token
    weights = torch.rand(6, 2, generator=gen)
    want = quant_reference.quant_fused_moe(hidden, (w13, w2), weights, ids)
    # per token: sum_k weight_k * down_e(act(silu(gate_e act(x)) * up_e act(x)))
    dense13, dense2 = dequantize(w13), dequantize(w2)
    for t in range(6):
        total = torch.zeros(24)
        for k in range(2):
            e = int(ids[t, k])
            gate, up = (quantize_activation(hidden[t : t + 1], w13) @ dense13[e].T).chunk(2, dim=-1)
            total += weights[t, k] * (quantize_activation(torch.nn.functional.silu(gate) * up, w2) @ dense2[e].T)[0]
        assert torch.allclose(want[t], total, atol=1e-5)
    prepared = quant_dequant.prepare_quant_experts(w13, w2, torch.float32)
    assert max_error(quant_dequant.quant_fused_moe(hidden, prepared, weights, ids), want) < 1e-5


def test_registry_probes_quant_candidates_on_the_models_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XINSERVE_KERNEL_TIMING", "off")
    w8a8 = select(CPU_KERNELS, torch.device("cpu"), torch.float32, model_shapes(SHAPES[0]))
    assert w8a8.chosen["quant_linear"] == "int8mm"  # first in preference when not timed
    mixed = select(CPU_KERNELS, torch.device("cpu"), torch.float32, model_shapes(SHAPES[0], SHAPES[3]))
    assert mixed.chosen["quant_linear"] == "dequant"
    assert any(impl == "int8mm" and "int4" in reason for impl, reason in mixed.rejected["quant_linear"])
    dense = select(CPU_KERNELS, torch.device("cpu"), torch.float32, model_shapes())
    assert dense.chosen["quant_linear"] == "reference" and "quant_linear" not in dense.rejected


def test_a_wrong_candidate_is_rejected_by_the_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XINSERVE_KERNEL_TIMING", "off")
    # a kernel that forgets the zero points
    monkeypatch.setitem(quant_dequant.OPS, "prepare_quant_weight",
                        lambda w, dtype: quant_dequant.prepare_quant_weight(replace(w, zero=None), dtype))
    selection = select(CPU_KERNELS, torch.device("cpu"), torch.float32, model_shapes(SHAPES[3]))
    assert selection.chosen["quant_linear"] == "reference"
    assert any(impl == "dequant" and "max abs err" in reason for impl, reason in selection.rejected["quant_linear"])


def test_correct_candidates_pass_the_probe_in_bfloat16_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe's records keep outputs below one, so a bf16 result's rounding stays within tolerance."""
    monkeypatch.setenv("XINSERVE_KERNEL_TIMING", "off")
    experts = (QuantShape("int8", (1, 64), "int8_per_token", False, 64, 64, experts=8),
               QuantShape("int8", (1, 32), "int8_per_token", False, 64, 32, experts=8))
    selection = select(CPU_KERNELS, torch.device("cpu"), torch.bfloat16, model_shapes(SHAPES[0], *experts))
    assert selection.chosen["quant_linear"] == "int8mm" and selection.chosen["quant_fused_moe"] == "dequant"
