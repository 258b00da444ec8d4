"""Cutting a quantized record to a parallel rank's rows or input columns keeps its scale grid and zero
points with it: the cut dequantizes to the same cut of the whole weight (per-channel int8, block FP8
with a partial last block, packed int4 with group zero points, stacked experts), a cut inside one block
becomes a block of its own, and a cut that would put two blocks' scales in one is refused by name."""

import pytest
import torch

from xinserve.engines.quantization.slicing import slice_cols, slice_rows
from xinserve.kernels.quantized_weight import QuantizedWeight, dequantize, pack_int4


def _record(kind: str, rows: int = 96, cols: int = 80, experts: int = 0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(rows * cols)
    lead = (experts,) if experts else ()
    if kind == "int8_channel":
        block = (1, cols)
        q = torch.randint(-128, 128, (*lead, rows, cols), generator=g, dtype=torch.int8)
    elif kind == "fp8_block":
        block = (32, 32)
        q = (torch.randn(*lead, rows, cols, generator=g) * 100).to(torch.float8_e4m3fn)
    else:  # int4 groups of 16 with zero points
        block = (1, 16)
        q = pack_int4(torch.randint(-8, 8, (*lead, rows, cols), generator=g))
    grid = (*lead, -(-rows // block[0]), -(-cols // block[1]))
    scale = torch.rand(grid, generator=g) + 0.5
    zero = torch.randint(-3, 4, grid, generator=g).float() if kind == "int4_group" else None
    return QuantizedWeight(q, 4 if kind == "int4_group" else 8, scale, block, cols, rows, zero=zero)


@pytest.mark.parametrize("kind", ["int8_channel", "fp8_block", "int4_group"])
@pytest.mark.parametrize("experts", [0, 3])
def test_a_cut_dequantizes_to_the_same_cut_of_the_weight(kind: str, experts: int) -> None:
    record = _record(kind, experts=experts)
    whole = dequantize(record)  # [(E,) 96, 80]
    for start, length in ((0, 48), (48, 48), (64, 32), (40, 8)):  # (40, 8): inside one 32-row block
        if kind == "fp8_block" and start % 32 and start // 32 != (start + length - 1) // 32:
            continue
        torch.testing.assert_close(dequantize(slice_rows(record, start, length, "w")),
                                   whole[..., start : start + length, :], rtol=0, atol=0)
    for start, length in ((0, 40), (32, 48), (64, 16)):
        torch.testing.assert_close(dequantize(slice_cols(record, start, length, "w")),
                                   whole[..., start : start + length], rtol=0, atol=0)


def test_a_cut_inside_one_block_becomes_its_own_block_and_keeps_no_other_rows() -> None:
    cut = slice_rows(_record("fp8_block"), 40, 16, "w")
    assert cut.block == (16, 32) and cut.scale.shape == (1, 3) and cut.qweight.shape == (16, 80)
    assert cut.qweight.untyped_storage().nbytes() == 16 * 80  # a copy, not a view of the whole


def test_cuts_that_miss_the_scale_blocks_or_split_a_byte_are_refused() -> None:
    with pytest.raises(ValueError, match=r"layer\.w: rows \[48, 96\) of 96 does not fall on the scale blocks of 32"):
        slice_rows(_record("fp8_block"), 48, 48, "layer.w")
    with pytest.raises(ValueError, match=r"columns \[40, 80\) of 80 does not fall on the scale blocks of 32"):
        slice_cols(_record("fp8_block"), 40, 40, "layer.w")
    with pytest.raises(ValueError, match="split a byte of packed 4-bit values"):
        slice_cols(_record("int4_group", cols=96), 17, 15, "layer.w")
