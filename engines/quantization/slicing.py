"""Cutting a quantized record to the rows or input columns one parallel rank keeps.

A record's scale grid (and zero points) covers the weight in blocks (kernels/quantized_weight.py), so
a slice is exact only when its blocks are whole blocks of the original, cut at the slice's end at
most: the slice must start on a block edge (its last block may end mid-block, as the layout allows),
or lie inside one block, which then becomes a block the size of the slice (per-channel and
per-tensor grids, a head's rows inside a 128-row FP8 block). Anything else would put two original
blocks' scales in one new block, so it is refused with the layer and the shape that does not divide.
Packed int4 weights keep two input columns per byte: a column slice starts on an even column.
"""

from dataclasses import replace

from xinserve.kernels.quantized_weight import QuantizedWeight


def _grid_range(start: int, length: int, block: int, full: int, what: str) -> tuple[int, int, int]:
    """(first grid index, grid count, new block size) for ``[start, start + length)`` of ``full``."""
    end = start + length
    if start % block == 0:
        return start // block, -(-length // block), block
    if start // block == (end - 1) // block:  # inside one block: a block of its own
        return start // block, 1, length
    raise ValueError(f"{what} [{start}, {end}) of {full} does not fall on the scale blocks of {block}")


def slice_rows(record: QuantizedWeight, start: int, length: int, what: str) -> QuantizedWeight:
    """Output rows ``[start, start + length)`` (dim -2 of every tensor, so stacked experts too)."""
    if (start, length) == (0, record.out_features):
        return record
    first, count, rows = _grid_range(start, length, record.block[0], record.out_features, f"{what}: rows")
    grid = slice(first, first + count)
    # clones: a view would keep the whole checkpoint tensor alive
    return replace(record, qweight=record.qweight[..., start : start + length, :].clone(),
                   scale=record.scale[..., grid, :].clone(),
                   zero=None if record.zero is None else record.zero[..., grid, :].clone(),
                   block=(rows, record.block[1]), out_features=length)


def slice_cols(record: QuantizedWeight, start: int, length: int, what: str) -> QuantizedWeight:
    """Input columns ``[start, start + length)`` (dim -1 of every tensor)."""
    if (start, length) == (0, record.in_features):
        return record
    first, count, cols = _grid_range(start, length, record.block[1], record.in_features, f"{what}: columns")
    grid = slice(first, first + count)
    if record.bits == 4:
        if start % 2:
            raise ValueError(f"{what}: columns [{start}, {start + length}) of {record.in_features} split a byte "
                             "of packed 4-bit values")
        qweight = record.qweight[..., start // 2 : (start + length + 1) // 2]
    else:
        qweight = record.qweight[..., start : start + length]
    return replace(record, qweight=qweight.clone(), scale=record.scale[..., grid].clone(),
                   zero=None if record.zero is None else record.zero[..., grid].clone(),
                   block=(record.block[0], cols), in_features=length)
