"""AWQ (GEMM) checkpoints read into the canonical record: the interleaved nibble order undone, the
dequantized record equal to the weight the test quantized and packed by hand."""

from types import SimpleNamespace

import pytest
import torch

from tests.engines.quantization.int4_checkpoints import awq_tensors, quantize_groups, spread_weight
from xinserve.engines.quantization.formats import awq
from xinserve.kernels.quantized_weight import dequantize

MODULE = "model.layers.1.mlp.down_proj"
SETTINGS = {"quant_method": "awq", "bits": 4, "group_size": 16, "version": "gemm", "zero_point": True}
CONFIG = SimpleNamespace(quantization_config=SETTINGS)  # what the reader reads of a PretrainedConfig


def test_gemm_packing_dequantizes_to_the_quantized_weight() -> None:
    # 40 inputs in groups of 16 (a partial last group), 24 outputs = three packed words per row
    q, zero, scale, expected = quantize_groups(spread_weight(24, 40, seed=4), 16)
    parts = awq_tensors(q, zero, scale)
    tensors = [(f"{MODULE}.{k}", v) for k, v in reversed(parts.items())] + [("lm_head.weight", torch.ones(3))]
    out = dict(awq.read("/nonexistent", CONFIG, iter(tensors)))
    record = out[f"{MODULE}.weight"]
    assert (record.out_features, record.in_features, record.block) == (24, 40, (1, 16))
    assert torch.equal(dequantize(record), expected)
    assert torch.equal(out["lm_head.weight"], torch.ones(3))


def test_a_sequential_nibble_order_would_not_match() -> None:
    # guards the test itself: the interleaving matters for these values
    q, zero, scale, expected = quantize_groups(spread_weight(8, 16, seed=5), 16)
    parts = awq_tensors(q, zero, scale)
    record = dict(awq.read("/x", CONFIG, iter((f"{MODULE}.{k}", v) for k, v in parts.items())))[f"{MODULE}.weight"]
    assert torch.equal(dequantize(record), expected)
    shuffled = awq_tensors(q[[0, 2, 4, 6, 1, 3, 5, 7]], zero[[0, 2, 4, 6, 1, 3, 5, 7]], scale)
    wrong = dict(awq.read("/x", CONFIG, iter((f"{MODULE}.{k}", v) for k, v in shuffled.items())))
    assert not torch.equal(dequantize(wrong[f"{MODULE}.weight"]), expected)


@pytest.mark.parametrize("settings", [{"version": "gemv"}, {"zero_point": False}, {"bits": 8}])
def test_unimplemented_variants_are_refused(settings: dict) -> None:
    config = SimpleNamespace(quantization_config={**SETTINGS, **settings})
    with pytest.raises(ValueError, match="not implemented"):
        list(awq.read("/x", config, iter([])))


def test_detected_from_quant_method() -> None:
    assert awq.detect("/x", CONFIG)
    assert not awq.detect("/x", SimpleNamespace(quantization_config={"quant_method": "gptq"}))
