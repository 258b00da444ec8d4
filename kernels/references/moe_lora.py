"""The routed experts with per-row LoRA on their weights (PEFT's ``target_parameters`` on
``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``): the reference ``fused_moe`` plus, on each
(token, expert) row, the delta of the adapter in the token's slot, inside the SwiGLU:

    gate_up = w13[e] x + B13[s, e] A13[s, e] x          # [2I]
    out     = w2[e] h + B2[s, e] A2[s, e] h,  h = silu(gate) * up

weighted by the router like the base expert's output. Not a registry op: a vendor ``fused_moe`` cannot take
the delta (it sits before the activation), so a model that serves expert adapters runs its routed experts
here, on every platform. Scaling is folded into B when the adapter is loaded; base rows (slot -1) get an
exact zero delta, so they equal ``fused_moe``'s.

Stacks (S slots, E experts, R = max_lora_rank): a13 [S, E, R, Hd], b13 [S, E, 2I, R], a2 [S, E, R, I],
b2 [S, E, Hd, R]; slots [T] int64 in [-1, S).
"""

import torch
import torch.nn.functional as F

from xinserve.kernels.references.dense import add_back_to_tokens, silu_and_mul, sort_by_expert
from xinserve.kernels.references.lora import lora_expand, lora_shrink


def fused_moe_lora(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor, a13: torch.Tensor, b13: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """``fused_moe``'s contract (hidden [T, Hd] -> [T, Hd]) with each row's adapter on its experts."""
    if torch.compiler.is_compiling():  # an opaque op for torch.compile: the loop reads counts on the host
        return torch.ops.xinserve.fused_moe_lora(hidden, w13, w2, topk_weights, topk_ids, a13, b13, a2, b2, slots)
    return _experts(hidden, w13, w2, topk_weights, topk_ids, a13, b13, a2, b2, slots)


def _experts(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
             topk_ids: torch.Tensor, a13: torch.Tensor, b13: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor,
             slots: torch.Tensor) -> torch.Tensor:
    order, tokens, rows = sort_by_expert(hidden, topk_ids)
    row_slots = slots.index_select(0, tokens)  # [T * K], each sorted row's token's slot
    counts = torch.bincount(topk_ids.reshape(-1), minlength=w13.shape[0]).tolist()
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            x, s = rows[start : start + count], row_slots[start : start + count]  # [n, Hd], [n]
            gate_up = F.linear(x, w13[expert])  # [n, 2I]
            gate_up = lora_expand(gate_up, lora_shrink(x, a13[:, expert], s), b13[:, expert], s)
            h = silu_and_mul(gate_up)  # [n, I]
            down = F.linear(h, w2[expert])  # [n, Hd]
            outputs.append(lora_expand(down, lora_shrink(h, a2[:, expert], s), b2[:, expert], s))
            start += count
    return add_back_to_tokens(torch.cat(outputs), topk_weights, order, tokens, hidden)


@torch.library.custom_op("xinserve::fused_moe_lora", mutates_args=())
def _opaque(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
            topk_ids: torch.Tensor, a13: torch.Tensor, b13: torch.Tensor, a2: torch.Tensor, b2: torch.Tensor,
            slots: torch.Tensor) -> torch.Tensor:
    return _experts(hidden, w13, w2, topk_weights, topk_ids, a13, b13, a2, b2, slots)


_opaque.register_fake(lambda hidden, *weights_routing_and_stacks: torch.empty_like(hidden))
