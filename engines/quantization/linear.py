"""A linear layer whose weight stays quantized in memory: it holds what the ``quant_linear`` kernel
prepared from the checkpoint's record(s) (kernels/references/quant.py) and calls that kernel.

It stands in for an ``nn.Linear`` or a fused ``MergedLinear`` (q/k/v, gate/up) of a model built on the
meta device (engines/quantization/install.py swaps it in); the loader hands it one record per
checkpoint shard, and ``finish`` merges them (engines/quantization/records.py) and prepares them on
the device. The bias, when there is one, is an ordinary float parameter loaded like any other.

A row-parallel shard (``group`` given: o_proj / down_proj under tensor parallel) sums the ranks'
partial products with one all-reduce before adding the bias. Its per-token activation scales must be
those of the whole row, not of its columns, for the result to equal one device's: the ranks exchange
each token's largest magnitude (one all-gather of [T, 1]), quantize their columns with it here, and
the kernel runs weight-only on them (same math; a device's int8 GEMM is not used for these layers).
"""

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from xinserve.engines.quantization.records import merge_shards
from xinserve.kernels.ops import KernelOps
from xinserve.kernels.quantized_weight import (
    PER_TOKEN,
    QuantizedWeight,
    QuantShape,
    quant_shape,
    quantize_activation,
    weight_to,
)


class QuantLinear(nn.Module):
    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, ops: KernelOps,
                 group: Any | None = None) -> None:
        super().__init__()
        self.group = group  # row-parallel: the tensor-parallel collectives (engines/models/tensor_parallel.py)
        self.row_activation: QuantizedWeight | None = None  # per-token scheme quantized here over the row
        self.in_features, self.output_sizes = in_features, output_sizes
        self.out_features = sum(output_sizes)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None
        self.prepare, self.quant_linear = ops.prepare_quant_weight, ops.quant_linear
        self.shards: list[QuantizedWeight | None] = [None] * len(output_sizes)  # as loaded, until finish
        self.weights: list[Any] = []  # the prepared records, in output order
        self.shapes: list[QuantShape] = []  # what each prepared record was (for /health)

    def add(self, record: QuantizedWeight, name: str, shard: int | None) -> None:
        """Take checkpoint weight ``name``'s record as output shard ``shard`` (None: the whole output)."""
        index = shard or 0
        want = (self.output_sizes[index] if shard is not None else self.out_features, self.in_features)
        if (record.out_features, record.in_features) != want:
            raise ValueError(f"checkpoint weight {name!r} is {record.out_features} x {record.in_features}, "
                             f"expected {want[0]} x {want[1]}")
        if shard is None and len(self.shards) > 1:
            self.shards = [record]  # a checkpoint that stores the fused projection whole (GLM-4's gate_up_proj)
            self.output_sizes = [self.out_features]
        else:
            self.shards[index] = record

    def finish(self, name: str, device: torch.device, dtype: torch.dtype) -> None:
        """Merge the shards and prepare them on ``device`` for computing in ``dtype``."""
        missing = [i for i, shard in enumerate(self.shards) if shard is None]
        if missing:
            raise ValueError(f"checkpoint is missing the quantized shards {missing} of {name}")
        merged = merge_shards(self.shards)
        self.shapes = [quant_shape(r) for r in merged]
        if self.group is not None and merged[0].activation in PER_TOKEN:
            self.row_activation = merged[0]
            merged = [replace(r, activation="none") for r in merged]
        self.weights = [self.prepare(weight_to(r, device), dtype) for r in merged]
        self.shards = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out]."""
        flat = x.reshape(-1, self.in_features)
        if self.row_activation is not None:  # [T, 1] the whole row's largest magnitude per token
            amax = torch.stack(self.group.all_gather(flat.float().abs().amax(dim=-1, keepdim=True))).amax(0)
            flat = quantize_activation(flat, self.row_activation, amax)
        if len(self.weights) == 1 and self.group is None:
            out = self.quant_linear(flat, self.weights[0], self.bias)
        else:  # shards that could not be merged: one call each, outputs side by side
            out = torch.cat([self.quant_linear(flat, weight, None) for weight in self.weights], dim=-1)
            out = out if self.group is None else self.group.all_reduce(out)
            out = out if self.bias is None else out + self.bias
        return out.view(*x.shape[:-1], self.out_features)
