"""Quantized routed experts: each expert's gate/up and down records (one per expert, as the checkpoint
names them) merged and stacked into one [E, ...] record each (engines/quantization/records.py), prepared
once by the ``quant_fused_moe`` kernel and computed by it. Stands in for ``Experts``
(engines/models/moe.py), whose ``SparseMoeBlock`` calls it with the routing.

Under tensor parallel it holds every expert's intermediate slice and all-reduces its partial output
(``reduce``); under expert parallel it holds this rank's whole experts in their slots (``slots``:
checkpoint expert -> slot) and runs them through the block's dispatch (engines/models/expert_parallel.py).
A per-token activation scheme on the down projection needs each token's whole intermediate row, so
experts quantized so are refused split along that dim (expert parallel keeps them whole)."""

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from xinserve.engines.quantization.records import merge_shards, stack_experts
from xinserve.kernels.ops import KernelOps
from xinserve.kernels.quantized_weight import PER_TOKEN, QuantizedWeight, QuantShape, quant_shape, weight_to


class QuantExperts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, ops: KernelOps,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, slots: dict[int, int] | None = None,
                 dispatch: Any = None) -> None:
        super().__init__()
        self.reduce, self.slots = reduce, slots
        # expert parallel: the block's ExpertParallelDispatch, running this rank's experts with our kernel
        self.dispatch = None if dispatch is None else dispatch.with_fused_moe(self._local_experts)
        self.num_experts, self.hidden_size, self.intermediate_size = num_experts, hidden_size, intermediate_size
        self.prepare, self.quant_fused_moe = ops.prepare_quant_experts, ops.quant_fused_moe
        # (projection, expert, shard) -> record, until finish; projection "gate_up_proj" or "down_proj"
        self.records: dict[tuple[str, int, int], QuantizedWeight] = {}
        self.weights: Any = None  # what prepare_quant_experts returned
        self.shapes: list[QuantShape] = []  # what w13 and w2 were (for /health)

    def add(self, record: QuantizedWeight, name: str, projection: str, expert: int | None, shard: int | None) -> None:
        if expert is None:
            raise ValueError(f"checkpoint weight {name!r}: quantized experts stored stacked are not implemented "
                             "(one record per expert is)")
        want = (self.intermediate_size, self.hidden_size) if projection == "gate_up_proj" else (
            self.hidden_size, self.intermediate_size)
        if shard is None and projection == "gate_up_proj":
            want = (2 * self.intermediate_size, self.hidden_size)
        if (record.out_features, record.in_features) != want:
            raise ValueError(f"checkpoint weight {name!r} is {record.out_features} x {record.in_features}, "
                             f"expected {want[0]} x {want[1]}")
        self.records[(projection, expert if self.slots is None else self.slots[expert], shard or 0)] = record

    def _stacked(self, name: str, projection: str, shards: int) -> QuantizedWeight:
        per_expert = []
        for expert in range(self.num_experts):
            parts = [self.records.get((projection, expert, s)) for s in range(shards)]
            if parts[0] is not None and shards == 2 and parts[1] is None:
                parts = parts[:1]  # gate and up stored fused
            if any(part is None for part in parts):
                raise ValueError(f"checkpoint is missing quantized weights of expert {expert} of {name}.{projection}")
            merged = merge_shards(parts)
            if len(merged) != 1:
                raise ValueError(f"{name}: expert {expert}'s gate and up records cannot be merged "
                                 "(gate rows not a whole number of scale blocks): not implemented")
            per_expert.append(merged[0])
        return stack_experts(per_expert, f"{name}.{projection}")

    def finish(self, name: str, device: torch.device, dtype: torch.dtype) -> None:
        w13 = weight_to(self._stacked(name, "gate_up_proj", 2), device)
        w2 = weight_to(self._stacked(name, "down_proj", 1), device)
        if self.reduce is not None and w2.activation in PER_TOKEN:
            raise ValueError(f"{name}: experts whose down projection quantizes its input per token ({w2.activation}) "
                             "cannot be split along their intermediate dim exactly; enable expert parallel "
                             "(whole experts per rank)")
        self.records = {}
        self.shapes = [quant_shape(w13), quant_shape(w2)]
        self.weights = self.prepare(w13, w2, dtype)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x: [T, Hd], topk_weights / topk_ids: [T, K] -> [T, Hd]."""
        if self.dispatch is not None:
            return self.dispatch(x, self.weights, None, topk_weights, topk_ids)
        out = self.quant_fused_moe(x, self.weights, topk_weights, topk_ids)
        return out if self.reduce is None else self.reduce(out)

    def _local_experts(self, rows: torch.Tensor, weights: Any, _: None, topk_weights: torch.Tensor,
                       slots: torch.Tensor) -> torch.Tensor:
        """The dispatch's ``fused_moe``: rows [n, Hd] through this rank's experts ``slots`` [n, 1]."""
        return self.quant_fused_moe(rows, weights, topk_weights, slots)
