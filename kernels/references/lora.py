"""Multi-LoRA's two batched ops (vLLM's punica shape: shrink to the rank, expand back), the pure-torch
reference every other implementation is probed against.

A step's rows may each use another adapter, or none: ``slots`` gives each row's adapter slot on the device
(-1: the base model only). An adapter's A and B live in per-slot stacks padded to the largest rank
(zero rows and columns add nothing), its scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) folded into B
when it is loaded, so the ops take no scale. A merged projection (q/k/v, gate/up) stacks its slices' A
along the rank and holds a block-diagonal B: one shrink and one expand per projection.

The reference loops over the slots, masking the rows of the others: a few rank-R matmuls per slot, no host
sync, no gather of a [T, R, in] copy of the weights, so a decode step that calls it can be compiled or
graph-captured. Rows whose slot is -1 come out exactly unchanged (their delta is an exact zero).
"""

import torch


def lora_shrink(x: torch.Tensor, a_stack: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x: [T, in]; a_stack: [S, R, in]; slots: [T] int64 in [-1, S). Returns [T, R], row t = x[t] @ A[slot]^T
    (zeros where the slot is -1), in x's dtype."""
    out = x.new_zeros(x.shape[0], a_stack.shape[1])
    for slot in range(a_stack.shape[0]):
        mask = (slots == slot).unsqueeze(1).to(x.dtype)  # [T, 1]
        out += (x @ a_stack[slot].t()) * mask
    return out


def lora_expand(out: torch.Tensor, h: torch.Tensor, b_stack: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """out: [T, O] (the base projection's output); h: [T, R] (``lora_shrink``'s); b_stack: [S, O, R]. Adds
    row t's h[t] @ B[slot]^T to out[t] in place and returns out (rows whose slot is -1 unchanged)."""
    for slot in range(b_stack.shape[0]):
        mask = (slots == slot).unsqueeze(1).to(h.dtype)  # [T, 1]
        out += (h * mask) @ b_stack[slot].t()
    return out


OPS = {fn.__name__: fn for fn in (lora_shrink, lora_expand)}
