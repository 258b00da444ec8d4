"""One mixture-of-experts layer's adapter slots on its routed experts, and the experts' forward with them.

PEFT's ``target_parameters`` LoRA gives each expert its own A and B per targeted parameter
(engines/lora/expert_checkpoint.py): ``gate_up_proj`` (one A over the hidden size, B over the gate then up
rows) and ``down_proj``. Per slot and expert, padded to ``max_rank`` (zero rows and columns add nothing):

    a13 [S, E, R, Hd]   b13 [S, E, 2I, R]   a2 [S, E, R, I]   b2 [S, E, Hd, R]

Served on whole (unsharded, not expert-parallel, unquantized) experts only (engines/lora/targets.py).
"""

import torch
from torch import nn

from xinserve.engines.models.moe import Experts
from xinserve.kernels.references.moe_lora import fused_moe_lora

# PEFT's parameter name -> (our A stack, our B stack)
EXPERT_PARAMETERS = {"gate_up_proj": ("a13", "b13"), "down_proj": ("a2", "b2")}


class ExpertLoraStacks(nn.Module):
    def __init__(self, experts: Experts, max_loras: int, max_rank: int, step_slots: torch.Tensor,
                 device: torch.device, dtype: torch.dtype) -> None:
        """``step_slots``: the step's per-row slot buffer shared by every layer ([max rows] int64)."""
        super().__init__()
        num_experts, two_inter, hidden = experts.gate_up_proj.shape
        inter = two_inter // 2
        shapes = {"a13": (max_rank, hidden), "b13": (two_inter, max_rank), "a2": (max_rank, inter),
                  "b2": (hidden, max_rank)}
        for name, shape in shapes.items():
            self.register_buffer(name, torch.zeros(max_loras, num_experts, *shape, device=device, dtype=dtype),
                                 persistent=False)
        self.register_buffer("step_slots", step_slots, persistent=False)

    def forward(self, x: torch.Tensor, experts: Experts, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x: [T, Hd]; weights, ids: [T, K] (the router's). Returns the routed experts' output [T, Hd]."""
        slots = self.step_slots[: x.shape[0]]  # [T]
        return fused_moe_lora(x, experts.gate_up_proj, experts.down_proj, weights, ids, self.a13, self.b13,
                              self.a2, self.b2, slots)

    def write(self, slot: int, modules: dict[str, tuple[torch.Tensor, torch.Tensor]], layer_prefix: str) -> None:
        """Put an adapter's expert parameters (``layer_prefix`` + PEFT parameter name -> (A [E, r, in],
        B [E, out, r]) on the host) in ``slot``; parameters the adapter leaves out are zero."""
        for parameter, (a_name, b_name) in EXPERT_PARAMETERS.items():
            a_stack, b_stack = getattr(self, a_name)[slot], getattr(self, b_name)[slot]
            a_stack.zero_()
            b_stack.zero_()
            pair = modules.get(layer_prefix + parameter)
            if pair is not None:
                a, b = pair
                r = a.shape[1]
                a_stack[:, :r].copy_(a)
                b_stack[:, :, :r].copy_(b)

    def slot_bytes(self) -> int:
        return sum(getattr(self, name)[0].nbytes for pair in EXPERT_PARAMETERS.values() for name in pair)
