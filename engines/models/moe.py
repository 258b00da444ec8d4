"""The mixture-of-experts MLP: a router picks each token's experts and the experts run as one fused
kernel op (``ops.select_experts`` then ``ops.fused_moe``); shared experts, when the architecture has
them (GLM-4.5), see every token and are added on top.

Parameter names follow the Hugging Face checkpoints (``mlp.gate.weight``,
``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts.*``) except the routed experts, which
the loader stacks from each expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` into
``mlp.experts.gate_up_proj`` and ``mlp.experts.down_proj``.
"""

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from xinserve.engines.models.layers import GatedMLP
from xinserve.kernels.ops import KernelOps
from xinserve.kernels.routing import MoeRouting


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """An architecture's experts, read from its config."""

    num_experts: int
    intermediate_size: int  # one routed expert's
    routing: MoeRouting
    shared_intermediate_size: int = 0  # the shared experts' together (one wide MLP); 0: none


def grouped_moe(config: Any) -> tuple[MoeSpec, frozenset[int]]:
    """DeepSeek-V3's routing (GLM-4.5's too) and the layers that route: sigmoid scores, experts chosen
    by score plus ``e_score_correction_bias`` within the best ``topk_group`` of ``n_group`` groups,
    weighted by their unbiased scores (renormalised when ``norm_topk_prob``) times
    ``routed_scaling_factor``, plus ``n_shared_experts`` shared experts. MoE on the layers
    ``mlp_layer_types`` marks "sparse" (DeepSeek-V3.2, GLM-5), else from ``first_k_dense_replace`` on."""
    routing = MoeRouting(
        top_k=config.num_experts_per_tok, scoring="sigmoid", renormalize=bool(config.norm_topk_prob),
        num_groups=config.n_group, topk_groups=config.topk_group, correction_bias=True,
        scaling_factor=float(config.routed_scaling_factor),
    )
    moe = MoeSpec(config.n_routed_experts, config.moe_intermediate_size, routing,
                  shared_intermediate_size=config.moe_intermediate_size * config.n_shared_experts)
    types = getattr(config, "mlp_layer_types", None)
    if types:
        return moe, frozenset(i for i, kind in enumerate(types) if kind == "sparse")
    return moe, frozenset(range(config.first_k_dense_replace, config.num_hidden_layers))


class Router(nn.Linear):
    """Router logits over the experts, plus GLM-4.5's learned per-expert bias on their scores."""

    def __init__(self, hidden_size: int, num_experts: int, correction_bias: bool) -> None:
        super().__init__(hidden_size, num_experts, bias=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts)) if correction_bias else None


class Experts(nn.Module):
    """Every routed expert's SwiGLU weights, stacked: ``gate_up_proj`` [E, 2I, Hd] (each expert's
    gate rows, then its up rows) and ``down_proj`` [E, Hd, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.output_sizes = [intermediate_size, intermediate_size]  # gate_up_proj's shards, for the loader
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def slot(self, expert: int) -> int | None:
        """Where checkpoint expert ``expert`` goes in the stacked weights; None: not on this rank
        (expert parallel, engines/models/expert_parallel.py)."""
        return expert


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden_size: int, moe: MoeSpec, ops: KernelOps) -> None:
        super().__init__()
        self.routing = moe.routing
        self.gate = Router(hidden_size, moe.num_experts, moe.routing.correction_bias)
        self.experts = Experts(moe.num_experts, hidden_size, moe.intermediate_size)
        self.shared_experts = (
            GatedMLP(hidden_size, moe.shared_intermediate_size, bias=False, ops=ops)
            if moe.shared_intermediate_size else None
        )
        self.select_experts, self.fused_moe = ops.select_experts, ops.fused_moe
        # adapter slots on the routed experts (engines/lora/expert_stacks.py): then they run with each row's
        # adapter instead of ``fused_moe``
        self.lora: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, Hd] -> [T, Hd]."""
        # logits: [T, E] in float32, computed in the router weight's dtype: the model's, or float32
        # where the architecture keeps its router so (GLM-4.5), as transformers does
        logits = F.linear(x.to(self.gate.weight.dtype), self.gate.weight).float()
        weights, ids = self.select_experts(logits, self.routing, self.gate.e_score_correction_bias)  # [T, K] each
        if self.lora is not None:
            out = self.lora(x, self.experts, weights, ids)
        elif isinstance(self.experts, Experts):
            out = self.fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        else:  # quantized experts (engines/quantization/experts.py) call their own kernel
            out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)
