"""Integers packed into int32 words, as GPTQ and AutoAWQ store them, and their conversion to the
canonical 4- or 8-bit record (kernels/quantized_weight.py)."""

import torch

from xinserve.kernels.quantized_weight import QuantizedWeight, pack_int4

# AutoAWQ's GEMM packing: nibble k of a word holds column AWQ_ORDER[k] of its 8 columns, so column j is
# found in nibble AWQ_REVERSE_ORDER[j].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = tuple(AWQ_ORDER.index(j) for j in range(8))


def unpack_rows(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] int32 with 32 / bits values per word along the rows (value j of word r is row
    r * per_word + j, at bit j * bits) -> [R * per_word, C] int32 unsigned values."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    # an arithmetic right shift of a negative word drags the sign along; the mask drops it
    values = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)
    return values.reshape(-1, packed.shape[1])


def unpack_columns(packed: torch.Tensor, bits: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """[R, C] int32 packed along the columns -> [R, C * per_word] unsigned values. ``order[j]``: which
    slot of its word holds column j of the word's columns (None: slot j)."""
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per_word], by slot
    if order is not None:
        values = values[..., list(order)]
    return values.reshape(packed.shape[0], -1)


def grouped_record(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bits: int,
                   group_size: int) -> QuantizedWeight:
    """The canonical record of W[o, i] = (q[o, i] - zero[o, i // g]) * scale[o, i // g] with q and
    zero unsigned (0 .. 2^bits - 1): q [out, in], zero and scale [out, ceil(in / g)]. The values
    move to the signed domain (minus 2^(bits-1)) on both sides, which leaves W unchanged; a zero
    grid that is then all 0 (symmetric) is dropped."""
    out_features, in_features = q.shape
    half = 1 << (bits - 1)
    signed = q.to(torch.int16) - half
    qweight = pack_int4(signed) if bits == 4 else signed.to(torch.int8)
    zero = zero.float() - half
    return QuantizedWeight(
        qweight=qweight.contiguous(), bits=bits, scale=scale.float().contiguous(), block=(1, group_size),
        in_features=in_features, out_features=out_features,
        zero=None if not zero.any() else zero.contiguous(),
    )
