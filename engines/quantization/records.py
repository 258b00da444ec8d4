"""Putting quantized records together the way the model fuses its projections.

Shards of a fused projection (q/k/v, gate/up) are concatenated along the output dim into one record
when that changes nothing: the same type, block width, activation scheme and static input scale,
zero points on all or none, and every shard but the last a whole number of block rows (each block
then still covers rows of one shard only). Otherwise the shards stay separate records, computed one
after the other and their outputs concatenated: exact, at the price of a few more kernel calls
(per-tensor FP8's q/k/v, whose one-block-per-tensor grids differ; block FP8 shards that end
mid-block). Requantizing to a shared scale, as vLLM does for per-tensor FP8, would change the math.
"""

import torch

from xinserve.kernels.quantized_weight import QuantizedWeight


def _same_scheme(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    def same(x: torch.Tensor | None, y: torch.Tensor | None) -> bool:
        return (x is None) == (y is None) and (x is None or torch.equal(x, y))

    return (a.bits == b.bits and a.qweight.dtype == b.qweight.dtype and a.block[1] == b.block[1]
            and a.in_features == b.in_features and a.activation == b.activation
            and (a.zero is None) == (b.zero is None) and same(a.input_scale, b.input_scale)
            and same(a.input_offset, b.input_offset))


def _concatenable(a: QuantizedWeight, b: QuantizedWeight) -> bool:
    return _same_scheme(a, b) and a.block[0] == b.block[0] and a.out_features % a.block[0] == 0


def concat_out(records: list[QuantizedWeight]) -> QuantizedWeight:
    """Records of ``concatenable`` shards -> one record of all their rows (along the output dim,
    dim -2 of every tensor, so stacked experts work too)."""
    first = records[0]
    if len(records) == 1:
        return first

    def cat(name: str) -> torch.Tensor | None:
        parts = [getattr(r, name) for r in records]
        return None if parts[0] is None else torch.cat(parts, dim=-2)

    return QuantizedWeight(cat("qweight"), first.bits, cat("scale"), first.block, first.in_features,
                           sum(r.out_features for r in records), zero=cat("zero"), activation=first.activation,
                           input_scale=first.input_scale, input_offset=first.input_offset)


def merge_shards(shards: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """A fused projection's shards, in output order -> as few records as ``concat_out`` allows."""
    groups: list[list[QuantizedWeight]] = [[shards[0]]]
    for shard in shards[1:]:
        if _concatenable(groups[-1][-1], shard):
            groups[-1].append(shard)
        else:
            groups.append([shard])
    return [concat_out(group) for group in groups]


def stack_experts(records: list[QuantizedWeight], what: str) -> QuantizedWeight:
    """One record per expert (each already merged to one) -> one [E, ...] record. Raises ValueError
    when the experts differ in scheme (a static input scale per expert is not implemented)."""
    first = records[0]
    for record in records[1:]:
        if not (_same_scheme(first, record) and record.block == first.block
                and record.out_features == first.out_features):
            raise ValueError(f"{what}: experts quantized with different schemes, shapes or static input "
                             "scales are not implemented")

    def stack(name: str) -> torch.Tensor | None:
        parts = [getattr(r, name) for r in records]
        return None if parts[0] is None else torch.stack(parts)

    return QuantizedWeight(stack("qweight"), first.bits, stack("scale"), first.block, first.in_features,
                           first.out_features, zero=stack("zero"), activation=first.activation,
                           input_scale=first.input_scale, input_offset=first.input_offset)
