"""Which part of each quantized record one rank keeps under tensor, expert and pipeline parallelism.

The model is first built and split on the meta device exactly as the rank will run it
(engines/models/tensor_parallel.py, expert_parallel.py, pipeline_parallel.py); each sharded module
says which rows or input columns of a checkpoint weight it holds, and the record is cut the same way
(engines/quantization/slicing.py), its scale grid and zero points with it: column-parallel modules
(q/k/v, gate/up, MLA's per-head q_b_proj) keep rows, row-parallel ones (o_proj, down_proj) input
columns, routed experts split along their intermediate dim keep both, expert-parallel ranks keep
their whole experts and drop the others, a pipeline stage drops the other stages' layers. A fused
checkpoint tensor (GLM-4's gate_up_proj) is cut per part and put back together.

The records are cut as the checkpoint reader yields them, so a rank holds its own part of the
quantized checkpoint plus one whole tensor at a time, never all of it. What a rank keeps none of
(another stage's layers, another rank's experts) is not read at all (``keeps``); a tensor it keeps a
slice of is still read whole, as each format's reader converts whole tensors.
"""

from collections.abc import Iterable
from typing import Any

import torch

from xinserve.engines.models.moe import Experts
from xinserve.engines.models.tensor_parallel import (
    ColumnParallelMerged,
    ParallelExperts,
    RowParallelLinear,
    read_shard,
)
from xinserve.engines.quantization.install import is_float_weight
from xinserve.engines.quantization.records import merge_shards
from xinserve.engines.quantization.slicing import slice_cols, slice_rows
from xinserve.kernels.quantized_weight import QuantizedWeight, dequantize


class TensorPiece:
    """A tensor already read, indexed like a safetensors slice (what ``read_shard`` takes)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self.tensor[index].clone()  # a view would keep the whole tensor alive

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)


def _joined(parts: list[QuantizedWeight], what: str) -> QuantizedWeight:
    merged = merge_shards(parts)
    if len(merged) != 1:
        raise ValueError(f"{what}: this rank's rows of the fused parts end mid scale block and cannot be joined "
                         "into one record")
    return merged[0]


def shard_record(model: Any, name: str, record: QuantizedWeight, model_name: str) -> QuantizedWeight | None:
    """This rank's part of checkpoint record ``name``; None when the rank keeps none of it (another
    stage's layer, another rank's expert). ``model``: the rank's model split on the meta device.
    Raises ValueError naming the model, the weight and its shape when a cut misses the scale blocks."""
    if model._skipped(name):
        return None
    target, expert, shard = model._target(name)
    module_name, _, leaf = target.rpartition(".")
    module = model.get_submodule(module_name)
    what = (f"model {model_name}: quantized weight {name} ({record.out_features} x {record.in_features}, "
            f"scale blocks {record.block[0]} x {record.block[1]}) cannot be split over the ranks")
    if isinstance(module, Experts) and expert is not None and module.slot(expert) is None:
        return None
    if isinstance(module, ParallelExperts):  # every expert's intermediate slice
        start, local = module.start, module.output_sizes[0]
        if leaf == "down_proj":
            return slice_cols(record, start, local, what)
        if shard is not None:
            return slice_rows(record, start, local, what)
        full = module.full_intermediate
        return _joined([slice_rows(record, start, local, what), slice_rows(record, full + start, local, what)], what)
    if isinstance(module, ColumnParallelMerged):
        if shard is not None:
            return slice_rows(record, *module.ranges[shard], what)
        parts, offset = [], 0
        for full, (start, length) in zip(module.full_sizes, module.ranges):
            parts.append(slice_rows(record, offset + start, length, what))
            offset += full
        return _joined(parts, what)
    if isinstance(module, RowParallelLinear):
        return slice_cols(record, module.start, module.in_features, what)
    return record


def keeps(model: Any, name: str) -> bool:
    """Whether this rank reads checkpoint tensor ``name`` at all (any leaf: a weight, its scales, its
    zero points): not when it belongs to another pipeline stage or to another rank's whole expert, so an
    expert-parallel rank reads about 1 / EP of the routed experts' bytes and a stage its own layers'."""
    if name.startswith(model.absent_weights):
        return False
    parts = name.split(".")
    if "experts" not in parts[:-2]:
        return True
    at = parts.index("experts")
    if not parts[at + 1].isdigit():
        return True
    experts = model.get_submodule(".".join(parts[: at + 1]))
    return not isinstance(experts, Experts) or experts.slot(int(parts[at + 1])) is not None


def read_rank_part(model: Any, model_cls: type, entries: Iterable[tuple[str, Any]], model_name: str
                   ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, QuantizedWeight]]]:
    """A quantized checkpoint's (name, tensor or record) stream -> (float tensors, records) of this
    rank, cut as they arrive. ``model``: the rank's model split on the meta device, or None for a
    model on one device (everything kept). The model's ``FLOAT_WEIGHTS`` records are dequantized
    (float32) before they are cut."""
    floats, records = [], []
    for name, value in entries:
        if isinstance(value, QuantizedWeight) and is_float_weight(model_cls, name):
            value = dequantize(value)
        if isinstance(value, QuantizedWeight):
            part = value if model is None else shard_record(model, name, value, model_name)
            if part is not None:
                records.append((name, part))
        elif model is None:
            floats.append((name, value))
        elif not model._skipped(name):
            floats.append((name, read_shard(model, name, TensorPiece(value))))
    return floats, records
