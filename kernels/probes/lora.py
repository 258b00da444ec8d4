"""Probe and timing workload of the multi-LoRA op (``lora_shrink`` / ``lora_expand``, kernels/references/lora.py;
see kernels/probes/checks.py, kernels/probes/timing.py).

The probe runs a candidate on the model's four adapted projections (fused q/k/v and gate/up with their
slices' ranks stacked, o_proj, down_proj) at the model's ``max_lora_rank`` and ``max_loras``, with a
projection's outputs cut to at most ``MAX_ROWS`` (accuracy depends on the summed length, not on the
outputs' count), at decode row counts on both sides of a per-row kernel's limit and a prefill whose rows
come in runs of one adapter. Slots mix base-model rows (-1), repeated slots and the last slot. Each op is
compared with the reference in float32 on the host, on the same inputs; a base-model row that is not
exactly as it was (expand) or exactly zero (shrink) fails the candidate outright, as does an expand that
does not write into the tensor it is given.

The timing workload is one decode step's LoRA ops over those projections at full size, batch
``DECODE_ROWS`` with mixed slots.
"""

from collections.abc import Callable

import torch

from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.probes.inputs import ProbeInputs, max_error, to_host32
from xinserve.kernels.references import lora as lora_reference

MAX_ROWS = 320
DECODE_TOKENS = (1, 5, 33)  # a lone row, a small batch, one past a per-row (bgmv) kernel's 32 rows
PREFILL_RUNS = ((-1, 9), (0, 23), (-2, 17), (-1, 4), (0, 11))  # (slot, rows): -2 the last slot, 64 rows
DECODE_ROWS = 8


def adapted_projections(shapes: ModelShapes) -> list[tuple[int, int, int]]:
    """(in, out, rank) of the projections an adapter targets: q/k/v and gate/up stack their slices' A
    along the rank (kernels/references/lora.py), so their rank is 3 and 2 times ``max_lora_rank``."""
    q, kv = shapes.num_heads * shapes.head_dim, shapes.num_kv_heads * shapes.head_dim
    hidden, inter, rank = shapes.hidden_size, shapes.intermediate_size, shapes.max_lora_rank
    return [(hidden, q + 2 * kv, 3 * rank), (q, hidden, rank), (hidden, 2 * inter, 2 * rank), (inter, hidden, rank)]


def _slot_patterns(num_slots: int, x: ProbeInputs) -> list[torch.Tensor]:
    """[T] int64 slots per probed batch: decode rows in random order and a prefill in runs of one slot."""
    last = num_slots - 1
    patterns = [torch.tensor([last])]
    for rows in DECODE_TOKENS[1:]:
        slots = torch.randint(-1, num_slots, (rows,), generator=x.generator)
        slots[:3] = torch.tensor([-1, last, last])  # a base row, and the last slot twice
        patterns.append(slots)
    run_slots = torch.tensor([last if slot == -2 else slot for slot, _ in PREFILL_RUNS])
    patterns.append(torch.repeat_interleave(run_slots, torch.tensor([rows for _, rows in PREFILL_RUNS])))
    return patterns


def _untouched_rows_error(got: torch.Tensor, before: torch.Tensor, slots: torch.Tensor) -> float:
    """0 when the base-model rows of ``got`` are bit for bit ``before``'s, else inf."""
    base = (slots < 0).cpu()
    return 0.0 if torch.equal(got.cpu()[base], before.cpu()[base]) else float("inf")


def probe_lora(fn: dict[str, Callable], shapes: ModelShapes, x: ProbeInputs) -> float:
    num_slots, errors = shapes.max_loras, []
    for slots_host in _slot_patterns(num_slots, x):
        slots, rows = slots_host.to(x.device), len(slots_host)
        for n_in, n_out, rank in adapted_projections(shapes):
            n_out = min(n_out, MAX_ROWS)
            # scaled so that h and each output stay below about 3 (bfloat16's tolerance assumes order one)
            a_stack = x.randn(num_slots, rank, n_in) * (0.5 * n_in**-0.5)
            b_stack = x.randn(num_slots, n_out, rank) * (0.5 * rank**-0.5)
            hidden, h = x.randn(rows, n_in), 0.5 * x.randn(rows, rank)
            got_h = fn["lora_shrink"](hidden, a_stack, slots)
            errors.append(max_error(got_h, lora_reference.lora_shrink(*map(to_host32, (hidden, a_stack)), slots_host)))
            errors.append(_untouched_rows_error(got_h, torch.zeros_like(got_h), slots_host))
            before = 0.5 * x.randn(rows, n_out)
            out = before.clone()
            returned = fn["lora_expand"](out, h, b_stack, slots)
            want = lora_reference.lora_expand(to_host32(before).clone(), *map(to_host32, (h, b_stack)), slots_host)
            errors.extend((max_error(out, want), max_error(returned, want), _untouched_rows_error(out, before, slots)))
    return max(errors)


def lora_workload(fn: dict[str, Callable], shapes: ModelShapes, device: torch.device,
                  dtype: torch.dtype) -> Callable[[], object]:
    generator = torch.Generator().manual_seed(0)
    num_slots = shapes.max_loras

    def randn(*shape: int) -> torch.Tensor:
        return (0.1 * torch.randn(*shape, generator=generator)).to(device, dtype)

    # base rows and every slot, in a mixed order
    slots = (torch.arange(DECODE_ROWS) * 5 % (num_slots + 1) - 1).to(device)
    calls = [(randn(DECODE_ROWS, n_in), randn(num_slots, rank, n_in), randn(num_slots, n_out, rank),
              randn(DECODE_ROWS, n_out)) for n_in, n_out, rank in adapted_projections(shapes)]
    shrink, expand = fn["lora_shrink"], fn["lora_expand"]

    def run() -> None:
        for hidden, a_stack, b_stack, out in calls:
            expand(out, shrink(hidden, a_stack, slots), b_stack, slots)

    return run


PROBES = {"lora": probe_lora}
WORKLOADS = {"lora": lora_workload}
