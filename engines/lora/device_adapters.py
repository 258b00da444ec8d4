"""A model's adapter slots on one device (one rank): the ``LoraStacks`` of every served projection (and the
``ExpertLoraStacks`` of every mixture-of-experts layer whose routed experts are served), the step's per-row slot buffer they read, the host copies of the loaded adapters, and which adapter each
slot holds.

Which adapter goes in which slot is the scheduler's choice (engines/lora/slot_table.py); a step carries
each of its (slot, adapter id) pairs and ``apply`` writes a slot whose content differs before the forward,
on the thread that runs the steps, so a slot is rewritten only after every earlier step has read it.
"""

import numpy as np
import torch
from torch import nn

from xinserve.engines.lora.expert_stacks import ExpertLoraStacks
from xinserve.engines.lora.peft_checkpoint import AdapterWeights, read_adapter
from xinserve.engines.lora.stacks import LoraStacks
from xinserve.engines.lora.targets import ModelTargets
from xinserve.engines.models.layers import GatedMLP, Linear, MergedLinear
from xinserve.engines.models.tensor_parallel import ColumnParallelMerged, RowParallelLinear
from xinserve.kernels.ops import KernelOps

# our projection -> the PEFT modules it stands for, in slice order
PROJECTIONS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "o_proj": ["o_proj"],
               "gate_up_proj": ["gate_proj", "up_proj"], "down_proj": ["down_proj"]}


class DeviceAdapters:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int, max_rows: int, ops: KernelOps) -> None:
        """``max_rows``: the most token rows a step (or a decode bucket) has."""
        self.targets = ModelTargets.of(model)
        self.max_rank = max_rank
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.step_slots = torch.full((max_rows,), -1, dtype=torch.int64, device=self.device)  # [max rows]
        # (module prefix "layers.<i>.self_attn.", stacks); a MoE layer's experts: ("layers.<i>.mlp.experts.", ...)
        self.stacks: list[tuple[str, LoraStacks | ExpertLoraStacks]] = []
        for i, layer in enumerate(model.model.layers):
            modules = [("self_attn", layer.self_attn, ("qkv_proj", "o_proj"))]
            if isinstance(layer.mlp, GatedMLP):
                modules.append(("mlp", layer.mlp, ("gate_up_proj", "down_proj")))
            for block, parent, names in modules:
                for name in names:
                    stacks = self._stacks(getattr(parent, name), PROJECTIONS[name], max_loras, ops)
                    getattr(parent, name).lora = stacks
                    self.stacks.append((f"layers.{i}.{block}.", stacks))
            if i in self.targets.expert_layers:
                layer.mlp.lora = ExpertLoraStacks(layer.mlp.experts, max_loras, max_rank, self.step_slots,
                                                  self.device, self.dtype)
                self.stacks.append((f"layers.{i}.mlp.experts.", layer.mlp.lora))
        self.host: dict[int, AdapterWeights] = {}  # adapter id -> its host copy
        self.written: list[int | None] = [None] * max_loras  # the adapter id each slot holds on the device

    def _stacks(self, linear: nn.Module, slices: list[str], max_loras: int, ops: KernelOps) -> LoraStacks:
        """Stacks shaped and split like ``linear``'s weight."""
        if isinstance(linear, ColumnParallelMerged):  # this rank's rows of each slice
            ranges, in_range = linear.ranges, (0, linear.in_features)
        elif isinstance(linear, RowParallelLinear):  # this rank's input columns
            ranges, in_range = [(0, linear.out_features)], (linear.start, linear.in_features)
        elif isinstance(linear, MergedLinear):
            ranges, in_range = [(0, size) for size in linear.output_sizes], (0, linear.in_features)
        elif type(linear) is Linear:
            ranges, in_range = [(0, linear.out_features)], (0, linear.in_features)
        else:
            raise ValueError(f"LoRA adapters are not supported on {type(linear).__name__} projections "
                             "(quantized weights) yet")
        out_ranges, local = [], 0
        for start, rows in ranges:
            out_ranges.append((local, start, rows))
            local += rows
        return LoraStacks(slices, out_ranges, in_range, max_loras, self.max_rank, self.step_slots, ops,
                          self.device, self.dtype)

    def load(self, adapter_id: int, path: str) -> AdapterWeights:
        """Read (and check) the adapter at ``path`` into its host copy; ValueError when it cannot be served."""
        weights = read_adapter(path, self.targets, self.max_rank)
        self.host[adapter_id] = weights
        return weights

    def drop(self, adapter_id: int) -> None:
        """Forget its host copy (a slot holding it is rewritten before another adapter's rows read it)."""
        self.host.pop(adapter_id, None)

    def apply(self, pairs: list[tuple[int, int]], row_slots: np.ndarray | None) -> None:
        """Before a step's forward: write each (slot, adapter id) the step uses whose slot holds another
        adapter, then the step's row slots ([T] int64, -1: base model) into the buffer the layers read."""
        for slot, adapter_id in pairs:
            if self.written[slot] != adapter_id:
                modules = self.host[adapter_id].modules
                for prefix, stacks in self.stacks:
                    stacks.write(slot, modules, prefix)
                self.written[slot] = adapter_id
        if row_slots is not None and len(row_slots):
            self.step_slots[: len(row_slots)].copy_(torch.from_numpy(row_slots), non_blocking=True)

    def slot_bytes(self) -> int:
        """One slot's bytes on this device, over every layer."""
        return sum(s.slot_bytes() for _, s in self.stacks)

    @property
    def serves_experts(self) -> bool:
        """Whether the routed experts run with adapters (engines/lora/expert_stacks.py): a host loop, which a
        captured graph would freeze."""
        return bool(self.targets.expert_layers)
