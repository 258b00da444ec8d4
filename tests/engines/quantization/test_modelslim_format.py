"""msModelSlim (ascendv1) checkpoints read into the canonical record: an export of msModelSlim itself
(W8A8 static from a float32 model, so deq_scale as int64 bits) and hand-written ones in its layout
(W8A8_DYNAMIC, a linear bias folded into quant_bias, W8A16 with offsets, W4A8 experts packed by
msModelSlim's own packer), and refusals naming what is not implemented."""

import sys
from pathlib import Path

import pydantic
import pytest
import torch
from safetensors.torch import load_file

from tests.engines.quantization.int4_checkpoints import spread_weight
from tests.engines.quantization.modelslim_checkpoints import (  # noqa: F401  (fixture)
    float_bits_as_int64,
    msmodelslim_w8a8,
    w4a8_pack,
    write_checkpoint,
    write_w8a8_dynamic,
)
from xinserve.engines.quantization.formats import modelslim
from xinserve.kernels.quantized_weight import QuantizedWeight, dequantize, quantize_activation

LINEAR = "model.layers.0.self_attn.q_proj"


def _read(path: Path) -> dict:
    tensors = {}
    for file in sorted(path.glob("quant_model_weight*.safetensors")):
        tensors.update(load_file(str(file)))
    return dict(modelslim.read(str(path), {}, iter(tensors.items())))


def _float_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next(model_dir.glob("*.safetensors"))))


@pytest.mark.parametrize("scheme", ["W8A8", "W8A8_DYNAMIC"])
def test_checkpoints_dequantize_to_the_float_model(
    scheme: str, msmodelslim_w8a8, tiny_models, tmp_path: Path  # noqa: F811
) -> None:
    """W8A8: msModelSlim's own export; W8A8_DYNAMIC: written in the layout it exports."""
    model_dir = Path(tiny_models("llama"))
    path = msmodelslim_w8a8 if scheme == "W8A8" else write_w8a8_dynamic(model_dir, tmp_path)
    assert modelslim.detect(str(path), {})
    stored = load_file(str(next(path.glob("quant_model_weight*.safetensors"))))
    if scheme == "W8A8":  # a float32 model: deq_scale holds float32 bit patterns as int64
        assert stored[f"{LINEAR}.deq_scale"].dtype == torch.int64
    original = _float_weights(model_dir)
    out = _read(path)
    records = {k: v for k, v in out.items() if isinstance(v, QuantizedWeight)}
    assert len(records) == 14  # 7 linears in each of 2 layers; lm_head stays float
    assert not any(k.endswith(".bias") for k in out)  # Llama: the derived bias is exactly 0
    for name, record in records.items():
        scale = stored[name.replace(".weight", ".weight_scale")]
        assert record.activation == ("int8_static" if scheme == "W8A8" else "int8_per_token")
        # deq_scale / input_scale gives back msModelSlim's weight scale, and the weight lies within
        # half a step of the float weight it was quantized from
        torch.testing.assert_close(record.scale, scale, rtol=1e-6, atol=0)
        error = (dequantize(record) - original[name]).abs()
        assert (error <= scale / 2 * (1 + 1e-5)).all(), name
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"):
        assert torch.equal(out[name], original[name])


@pytest.mark.parametrize("half_precision_model", [True, False])
def test_w8a8_static_bias_and_scale_are_derived_exactly(tmp_path: Path, half_precision_model: bool) -> None:
    """The record computes what the Ascend kernel computes: deq_scale * (x_q @ Wq.T + quant_bias)."""
    out_features, in_features = 6, 11
    generator = torch.Generator().manual_seed(0)
    weight = torch.randint(-127, 128, (out_features, in_features), generator=generator, dtype=torch.int8)
    weight_scale = torch.logspace(-3, 0, out_features)
    input_scale, input_offset = torch.tensor([0.05]), torch.tensor([-7.0])
    float_bias = torch.randn(out_features, generator=generator)
    deq_scale = input_scale * weight_scale
    quant_bias = torch.round(float_bias / deq_scale - weight.float().sum(1) * input_offset).to(torch.int32)
    parts = {"weight": weight, "input_scale": input_scale, "input_offset": input_offset,
             "deq_scale": float_bits_as_int64(deq_scale) if half_precision_model else deq_scale,
             "quant_bias": quant_bias, "weight_scale": weight_scale[:, None], "bias": float_bias,
             "weight_offset": torch.zeros(out_features, 1)}
    description = {f"{LINEAR}.{k}": "FLOAT" if k == "bias" else "W8A8" for k in parts}
    out = _read(write_checkpoint(tmp_path, {f"{LINEAR}.{k}": v for k, v in parts.items()}, description, "W8A8"))
    record, bias = out[f"{LINEAR}.weight"], out[f"{LINEAR}.bias"]
    x = torch.randn(5, in_features, generator=generator, dtype=torch.float64) * 3
    x_q = (torch.round(x / input_scale.double()) + input_offset.double()).clamp(-128, 127)
    ascend = deq_scale.double() * (x_q @ weight.double().T + quant_bias.double())
    canonical = quantize_activation(x, record).double() @ dequantize(record, torch.float64).T + bias.double()
    torch.testing.assert_close(canonical, ascend, rtol=1e-5, atol=1e-6)
    # the bias the kernel adds is the float bias rounded to deq_scale units
    assert ((bias - float_bias).abs() <= deq_scale / 2 * (1 + 1e-4)).all()


def test_w8a16_offsets_are_added_before_the_scale(tmp_path: Path) -> None:
    weight = torch.randint(-128, 128, (4, 24), dtype=torch.int8)
    scale, offset = torch.logspace(-2, 1, 8).view(4, 2), torch.arange(-4.0, 4.0).view(4, 2)
    tensors = {f"{LINEAR}.weight": weight, f"{LINEAR}.weight_scale": scale, f"{LINEAR}.weight_offset": offset}
    description = {name: "W8A16" for name in tensors}
    path = write_checkpoint(tmp_path, tensors, {**description, "group_size": 12}, "W8A16")
    record = _read(path)[f"{LINEAR}.weight"]
    expected = (weight.float() + offset.repeat_interleave(12, 1)) * scale.repeat_interleave(12, 1)
    assert record.block == (1, 12) and record.activation == "none"
    assert torch.equal(dequantize(record), expected)


def test_w4a8_dynamic_experts_unpack_along_the_output_rows(tmp_path: Path) -> None:
    """Two experts of a Qwen3-MoE layer, packed by msModelSlim's own packer; the router stays float."""
    tensors, description, expected = {}, {}, {}
    for expert in range(2):
        for proj, (rows, cols) in {"gate_proj": (6, 9), "down_proj": (10, 3)}.items():
            name = f"model.layers.0.mlp.experts.{expert}.{proj}"
            float_weight = spread_weight(rows, cols, seed=expert)
            scale = float_weight.abs().amax(1, keepdim=True) / 7
            values = torch.round(float_weight / scale).clamp(-8, 7).to(torch.int8)
            parts = {"weight": w4a8_pack(values), "weight_scale": scale, "weight_offset": torch.zeros(rows, 1),
                     "scale_bias": 8 * (values.float() * scale).sum(1, keepdim=True)}
            assert parts["weight"].shape == (rows // 2, cols)
            tensors.update({f"{name}.{k}": v for k, v in parts.items()})
            description.update({f"{name}.{k}": "W4A8_DYNAMIC" for k in parts})
            expected[f"{name}.weight"] = values.float() * scale
    tensors["model.layers.0.mlp.gate.weight"] = torch.randn(2, 9)
    description["model.layers.0.mlp.gate.weight"] = "FLOAT"
    out = _read(write_checkpoint(tmp_path, tensors, description, "W4A8_DYNAMIC"))
    assert torch.equal(out["model.layers.0.mlp.gate.weight"], tensors["model.layers.0.mlp.gate.weight"])
    for name, weight in expected.items():
        record = out[name]
        assert record.bits == 4 and record.activation == "int8_per_token"
        assert torch.equal(dequantize(record), weight), name


def test_unimplemented_schemes_are_refused_by_name(tmp_path: Path) -> None:
    tensors = {f"{LINEAR}.weight": torch.zeros(2, 4, dtype=torch.int8), f"{LINEAR}.weight_scale": torch.ones(2, 1)}
    path = write_checkpoint(tmp_path / "w4a4", tensors, {n: "W4A4_DYNAMIC" for n in tensors}, "W4A4_DYNAMIC")
    with pytest.raises(ValueError, match="W4A4_DYNAMIC"):
        _read(path)
    path = write_checkpoint(tmp_path / "c8", tensors, {**{n: "W8A8_DYNAMIC" for n in tensors},
                                                       "kv_quant_type": "C8"}, "W8A8_DYNAMIC")
    with pytest.raises(ValueError, match="kv_quant_type"):
        _read(path)


def test_missing_tensors_and_norm_biases_are_refused(tmp_path: Path) -> None:
    tensors = {f"{LINEAR}.weight": torch.zeros(2, 4, dtype=torch.int8)}
    description = {f"{LINEAR}.weight": "W8A8", f"{LINEAR}.deq_scale": "W8A8"}
    with pytest.raises(ValueError, match="deq_scale"):
        _read(write_checkpoint(tmp_path / "missing", tensors, description, "W8A8"))
    norm = {"model.layers.0.input_layernorm.bias": torch.ones(4)}
    with pytest.raises(ValueError, match="norm bias"):
        _read(write_checkpoint(tmp_path / "norm", norm, {n: "FLOAT" for n in norm}, "W8A8"))
    assert not modelslim.detect(str(tmp_path / "nothing"), {})


def test_using_msmodelslim_leaves_pydantic_unpatched(msmodelslim_w8a8) -> None:  # noqa: F811
    # Importing msModelSlim patches pydantic.BaseModel process-wide; the tests keep it in a child process.
    w4a8_pack(torch.zeros(2, 4, dtype=torch.int8))
    assert "msmodelslim" not in sys.modules
    assert pydantic.BaseModel.__module__ == "pydantic.main"
