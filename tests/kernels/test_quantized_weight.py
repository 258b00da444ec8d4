"""The canonical quantized-weight layout: 4-bit packing round-trips, partial edge blocks get their
own scale, zero points and static activation offsets apply as documented."""

import pytest
import torch

from xinserve.kernels.quantized_weight import (
    QuantizedWeight,
    dequantize,
    expand_grid,
    pack_int4,
    quantize_activation,
    unpack_int4,
)


def test_int4_packing_round_trips_with_an_odd_column_count() -> None:
    values = torch.randint(-8, 8, (5, 7), generator=torch.Generator().manual_seed(0))
    packed = pack_int4(values)
    assert packed.shape == (5, 4) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed, 7), values.to(torch.int8))
    # column 0 in the low nibble, as the layout says
    assert int(packed[0, 0]) & 0x0F == int(values[0, 0]) + 8


def test_out_of_range_4bit_values_are_refused() -> None:
    with pytest.raises(ValueError, match="-8..7"):
        pack_int4(torch.tensor([[8]]))


def test_partial_edge_blocks_take_their_own_scale() -> None:
    # 5 x 3 weight in 2 x 2 blocks: a 3 x 2 grid, the last row and column of blocks partial
    q = torch.ones(5, 3, dtype=torch.int8)
    scale = torch.arange(1.0, 7.0).view(3, 2)
    w = dequantize(QuantizedWeight(q, 8, scale, (2, 2), in_features=3, out_features=5))
    assert w[4, 2] == 6.0 and w[4, 0] == 5.0 and w[1, 1] == 1.0 and w[2, 2] == 4.0
    assert expand_grid(scale, (2, 2), 5, 3).shape == (5, 3)


def test_zero_points_and_4bit_groups() -> None:
    values = torch.tensor([[-8, 7, 0, 1]])
    weight = QuantizedWeight(pack_int4(values), 4, torch.tensor([[2.0, 0.5]]), (1, 2), in_features=4,
                             out_features=1, zero=torch.tensor([[1.0, -1.0]]))
    assert dequantize(weight).tolist() == [[-18.0, 12.0, 0.5, 1.0]]


def test_static_int8_activation_applies_the_offset() -> None:
    weight = QuantizedWeight(torch.ones(1, 2, dtype=torch.int8), 8, torch.ones(1, 1), (1, 2), 2, 1,
                             activation="int8_static", input_scale=torch.tensor(0.5),
                             input_offset=torch.tensor(10.0))
    x = torch.tensor([[1.26, 70.0]])
    # 1.26 / 0.5 = 2.52 -> 3 (+10 = 13) -> 1.5; 70 / 0.5 = 140 (+10 = 150) clamps at 127 -> (127 - 10) * 0.5
    assert quantize_activation(x, weight).tolist() == [[1.5, 58.5]]


def test_static_activation_without_a_scale_is_refused() -> None:
    with pytest.raises(ValueError, match="input_scale"):
        QuantizedWeight(torch.ones(1, 1, dtype=torch.int8), 8, torch.ones(1, 1), (1, 1), 1, 1,
                        activation="int8_static")
