"""One projection's adapter slots on the device, and the delta it adds to the projection's output.

A projection standing for several PEFT modules (qkv_proj: q, k, v; gate_up_proj: gate, up) stacks its
slices' A along the rank and holds a block-diagonal B (kernels/references/lora.py):

    a_stack [S, slices * R, in_local]    slice s's A in rows [s * R, s * R + r)
    b_stack [S, out_local, slices * R]   slice s's B in the slice's output rows, columns [s * R, s * R + r)

Tensor parallel: a column-parallel projection holds the rows of B its weight holds (``out_ranges``), A
whole; a row-parallel one the input columns of A its weight holds (``in_range``), B whole, and its partial
delta is summed by the projection's all-reduce.
"""

import torch
from torch import nn

from xinserve.kernels.ops import KernelOps


class LoraStacks(nn.Module):
    def __init__(self, slices: list[str], out_ranges: list[tuple[int, int, int]], in_range: tuple[int, int],
                 max_loras: int, max_rank: int, step_slots: torch.Tensor, ops: KernelOps,
                 device: torch.device, dtype: torch.dtype) -> None:
        """``slices``: the PEFT modules in slice order; ``out_ranges[s]``: (first row of slice s in the local
        output, first row of its part in the full B, rows); ``in_range``: (first column in the full A,
        columns); ``step_slots``: the step's per-row slot buffer shared by every layer ([max rows] int64)."""
        super().__init__()
        self.slices, self.out_ranges, self.in_range = slices, out_ranges, in_range
        self.max_rank = max_rank
        self.ops = ops  # swapped with the layers' when the warm-up builds kernels (engines/worker/warmup.py)
        out_local = sum(rows for _, _, rows in out_ranges)
        ranks = len(slices) * max_rank
        self.register_buffer("a_stack", torch.zeros(max_loras, ranks, in_range[1], device=device, dtype=dtype),
                             persistent=False)
        self.register_buffer("b_stack", torch.zeros(max_loras, out_local, ranks, device=device, dtype=dtype),
                             persistent=False)
        self.register_buffer("step_slots", step_slots, persistent=False)

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """x: [T, in_local]; out: [T, out_local], the projection's output: returns it plus each row's delta."""
        slots = self.step_slots[: x.shape[0]]  # [T]; a decode bucket's rows are a static view
        return self.ops.lora_expand(out, self.ops.lora_shrink(x, self.a_stack, slots), self.b_stack, slots)

    def write(self, slot: int, modules: dict[str, tuple[torch.Tensor, torch.Tensor]], layer_prefix: str) -> None:
        """Put an adapter's modules of this projection (``layer_prefix`` + PEFT name -> (A, B) on the host)
        in ``slot``; slices the adapter leaves out are zero."""
        self.a_stack[slot].zero_()
        self.b_stack[slot].zero_()
        first_col, cols = self.in_range
        r0 = self.max_rank
        for s, (name, (local, start, rows)) in enumerate(zip(self.slices, self.out_ranges)):
            pair = modules.get(layer_prefix + name)
            if pair is None:
                continue
            a, b = pair  # [r, in], [out, r]
            r = a.shape[0]
            self.a_stack[slot, s * r0 : s * r0 + r].copy_(a[:, first_col : first_col + cols])
            self.b_stack[slot, local : local + rows, s * r0 : s * r0 + r].copy_(b[start : start + rows])

    def slot_bytes(self) -> int:
        return self.a_stack[0].nbytes + self.b_stack[0].nbytes
