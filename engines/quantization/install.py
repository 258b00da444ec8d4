"""Fitting a model built on the meta device to a quantized checkpoint: the modules a quantized record
targets become ``QuantLinear`` / ``QuantExperts`` before anything is allocated (so no float copy of a
quantized weight ever exists), the records are handed to them after the float weights are loaded, and
the bytes the weights hold in memory are counted.

Only linear projections and routed experts hold quantized weights: a record for an embedding, a norm,
a router or ``lm_head`` is refused (every format here leaves them in floats). A model's
``FLOAT_WEIGHTS`` (MLA's ``kv_b_proj``, whose weight the attention reads directly) are dequantized at
load instead (engines/quantization/sharding.py, which also cuts each record to a parallel rank's part).
"""

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from xinserve.engines.models.decoder import CausalLM
from xinserve.engines.models.expert_parallel import ExpertParallelExperts
from xinserve.engines.models.moe import Experts, Router, SparseMoeBlock
from xinserve.engines.models.tensor_parallel import ParallelExperts, RowParallelLinear
from xinserve.engines.quantization.experts import QuantExperts
from xinserve.engines.quantization.linear import QuantLinear
from xinserve.kernels.ops import KernelOps
from xinserve.kernels.quantized_weight import QuantizedWeight, QuantShape, quant_shape

QUANT_MODULES = (QuantLinear, QuantExperts)


def is_float_weight(model_cls: type[CausalLM], name: str) -> bool:
    return name.endswith(model_cls.FLOAT_WEIGHTS)


def quant_shapes(records: Iterable[tuple[str, QuantizedWeight]], num_experts: int) -> tuple[QuantShape, ...]:
    """The distinct shapes the quant kernels will see, for the registry's probes: a dense record as it is,
    an expert's as part of the stacked [E, ...] record (gate and up as one)."""
    seen: dict[QuantShape, None] = {}
    for name, record in records:
        shape = quant_shape(record)
        parts = name.split(".")
        if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit():
            fused = parts[-2] in ("gate_proj", "up_proj", "w1", "w3")
            shape = dataclasses.replace(shape, experts=num_experts,
                                        out_features=shape.out_features * (2 if fused else 1))
        seen[shape] = None
    return tuple(seen)


def swap_quantized_modules(model: CausalLM, names: Iterable[str], ops: KernelOps) -> None:
    """On the meta-device model: replace every module a quantized record ``names`` targets (those the
    model skips, such as GLM-4.5's multi-token-prediction layer, are left alone). A tensor-parallel
    shard keeps its collectives: a row-parallel projection's all-reduce, split experts' all-reduce, or
    expert parallel's dispatch (engines/models/tensor_parallel.py, expert_parallel.py)."""
    for name in names:
        if model._skipped(name):
            continue
        target, _, _ = model._target(name)
        module_name = target.rsplit(".", 1)[0]
        module = model.get_submodule(module_name)
        if isinstance(module, QUANT_MODULES):
            continue
        parent, _, child = module_name.rpartition(".")
        if isinstance(module, Experts):
            hidden, inter = module.down_proj.shape[1:]  # down_proj: [E, Hd, I]
            replacement: nn.Module = QuantExperts(module.num_experts, hidden, inter, ops,
                                                  **_experts_collectives(model.get_submodule(parent)))
        elif isinstance(module, nn.Linear) and not isinstance(module, Router) and module is not model.lm_head:
            sizes = getattr(module, "output_sizes", [module.out_features])
            group = module.group if isinstance(module, RowParallelLinear) else None
            replacement = QuantLinear(module.in_features, list(sizes), module.bias is not None, ops, group)
        else:
            raise ValueError(f"checkpoint weight {name!r} is quantized, but {type(model).__name__} keeps "
                             f"{module_name} ({type(module).__name__}) in floats: quantized embeddings, norms, "
                             "routers and lm_head are not implemented")
        setattr(model.get_submodule(parent), child, replacement)


def _experts_collectives(block: SparseMoeBlock) -> dict[str, Any]:
    """QuantExperts' keyword arguments for the routed experts of ``block``, as split on the meta device."""
    experts = block.experts
    if isinstance(experts, ExpertParallelExperts):
        return {"slots": experts.slots, "dispatch": block.fused_moe}
    if isinstance(experts, ParallelExperts):
        return {"reduce": experts.group.all_reduce}
    return {}


def load_quantized(model: CausalLM, records: Iterable[tuple[str, QuantizedWeight]], device: torch.device,
                   dtype: torch.dtype) -> None:
    """Hand each record to its module, then merge and prepare every quantized module's weights."""
    for name, record in records:
        if model._skipped(name):
            continue
        target, expert, shard = model._target(name)
        module_name, leaf = target.rsplit(".", 1)
        module = model.get_submodule(module_name)
        if isinstance(module, QuantExperts):
            module.add(record, name, leaf, expert, shard)
        else:
            module.add(record, name, shard)
    for name, module in model.named_modules():
        if isinstance(module, QUANT_MODULES):
            module.finish(name, device, dtype)


def held_bytes(value: Any) -> int:
    """Bytes of the tensors in ``value``: a tensor, a list or tuple of values, or a dataclass of them."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, list | tuple):
        return sum(held_bytes(v) for v in value)
    if dataclasses.is_dataclass(value):
        return sum(held_bytes(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


def weights_report(model: nn.Module) -> dict[str, Any]:
    """What the weights hold in memory (for /health): ``float_bytes`` (parameters and buffers),
    ``quantized_bytes`` (what the quant kernels keep: the quantized records, or what a candidate
    prepared from them), their sum ``bytes``, and the quantized schemes ("int8 1x64 int8_per_token")."""
    float_bytes = sum(held_bytes(t) for t in (*model.parameters(), *model.buffers()))
    quantized = [m for m in model.modules() if isinstance(m, QUANT_MODULES)]
    quantized_bytes = sum(held_bytes(m.weights) for m in quantized)
    schemes = sorted({f"{s.qtype} {s.block[0]}x{s.block[1]} {s.activation}" for m in quantized
                      for s in m.shapes})
    return {"bytes": float_bytes + quantized_bytes, "float_bytes": float_bytes, "quantized_bytes": quantized_bytes,
            "quantized_schemes": schemes}
