"""GPTQ checkpoints read into the canonical record: the dequantized record equals the weight the test
quantized and packed by hand (per-row scale spread, a partial last group), act-order refused."""

from types import SimpleNamespace

import pytest
import torch

from tests.engines.quantization.int4_checkpoints import gptq_tensors, quantize_groups, spread_weight
from xinserve.engines.quantization.formats import gptq
from xinserve.kernels.quantized_weight import QuantizedWeight, dequantize

MODULE = "model.layers.0.self_attn.q_proj"


def _config(**settings) -> SimpleNamespace:
    """What the reader reads of a PretrainedConfig: its ``quantization_config``."""
    return SimpleNamespace(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 16,
                                                "desc_act": False, "sym": False, **settings})


def _read(config: SimpleNamespace, tensors: list[tuple[str, torch.Tensor]]) -> dict:
    return dict(gptq.read("/nonexistent", config, iter(tensors)))


@pytest.mark.parametrize("bits", [4, 8])
def test_asymmetric_groups_dequantize_to_the_quantized_weight(bits: int) -> None:
    # 40 inputs in groups of 16: the last group holds 8
    q, zero, scale, expected = quantize_groups(spread_weight(24, 40), 16, bits=bits)
    parts = gptq_tensors(q, zero, scale, 16, bits=bits)
    bias = torch.randn(24)
    # shards arrive in any order: scales first, the float tensors in between
    tensors = [(f"{MODULE}.scales", parts["scales"]), ("model.norm.weight", torch.ones(8)),
               (f"{MODULE}.bias", bias), (f"{MODULE}.qzeros", parts["qzeros"]),
               (f"{MODULE}.g_idx", parts["g_idx"]), (f"{MODULE}.qweight", parts["qweight"])]
    out = _read(_config(bits=bits), tensors)
    assert set(out) == {f"{MODULE}.weight", "model.norm.weight", f"{MODULE}.bias"}
    record = out[f"{MODULE}.weight"]
    assert isinstance(record, QuantizedWeight) and record.bits == bits and record.block == (1, 16)
    assert (record.out_features, record.in_features) == (24, 40) and record.zero is not None
    assert torch.equal(dequantize(record), expected)
    assert torch.equal(out[f"{MODULE}.bias"], bias)


def test_symmetric_checkpoints_drop_the_zero_grid() -> None:
    q, zero, scale, expected = quantize_groups(spread_weight(16, 32, seed=1), 16, symmetric=True)
    parts = gptq_tensors(q, zero, scale, 16)
    record = _read(_config(sym=True), [(f"{MODULE}.{k}", v) for k, v in parts.items()])[f"{MODULE}.weight"]
    assert record.zero is None and torch.equal(dequantize(record), expected)


def test_gptq_v2_stores_the_zero_itself() -> None:
    q, zero, scale, expected = quantize_groups(spread_weight(8, 16, seed=2), 16)
    parts = gptq_tensors(q, zero, scale, 16, zero_minus_one=False)
    record = _read(_config(checkpoint_format="gptq_v2"), [(f"{MODULE}.{k}", v) for k, v in parts.items()])
    assert torch.equal(dequantize(record[f"{MODULE}.weight"]), expected)


def test_act_order_with_a_permuted_g_idx_is_refused_and_a_contiguous_one_loads() -> None:
    q, zero, scale, expected = quantize_groups(spread_weight(8, 32, seed=3), 16)
    parts = gptq_tensors(q, zero, scale, 16)
    loaded = _read(_config(desc_act=True), [(f"{MODULE}.{k}", v) for k, v in parts.items()])
    assert torch.equal(dequantize(loaded[f"{MODULE}.weight"]), expected)
    parts["g_idx"] = parts["g_idx"].flip(0)
    with pytest.raises(ValueError, match="act-order"):
        _read(_config(desc_act=True), [(f"{MODULE}.{k}", v) for k, v in parts.items()])


def test_unimplemented_settings_and_incomplete_modules_are_refused() -> None:
    with pytest.raises(ValueError, match="3 bits"):
        _read(_config(bits=3), [])
    q, zero, scale, _ = quantize_groups(spread_weight(8, 16), 16)
    parts = gptq_tensors(q, zero, scale, 16)
    with pytest.raises(ValueError, match="missing"):
        _read(_config(), [(f"{MODULE}.qweight", parts["qweight"])])


def test_detected_from_the_config_or_the_legacy_quantize_config(tmp_path) -> None:
    assert gptq.detect(str(tmp_path), _config())
    assert not gptq.detect(str(tmp_path), SimpleNamespace(quantization_config={"quant_method": "awq"}))
    (tmp_path / "quantize_config.json").write_text('{"quant_method": "gptq", "bits": 4}')
    assert gptq.detect(str(tmp_path), SimpleNamespace())
