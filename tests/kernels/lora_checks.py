"""What every multi-LoRA implementation's tests check (tests/kernels/triton/test_triton_lora.py,
tests/kernels/ascend/test_npu_lora.py): shrink then expand against the float32 reference."""

from collections.abc import Callable

import torch

from xinserve.kernels.probes.inputs import max_error
from xinserve.kernels.references import lora as reference


def assert_ops_match_reference(shrink: Callable, expand: Callable, x: torch.Tensor, a_stack: torch.Tensor,
                               b_stack: torch.Tensor, before: torch.Tensor, slots: torch.Tensor,
                               tolerance: float) -> None:
    """Shrink x, expand into a copy of ``before``: both within ``tolerance`` of the reference, h in x's dtype,
    the expand in place, base-model rows (slot -1) bit for bit as they were and their h exactly zero."""
    h = shrink(x, a_stack, slots)
    assert h.dtype == x.dtype and h.shape == (len(slots), a_stack.shape[1])
    assert max_error(h, reference.lora_shrink(x.float(), a_stack.float(), slots.cpu())) <= tolerance
    out = before.clone()
    assert expand(out, h, b_stack, slots) is out
    want = reference.lora_expand(before.float(), h.float(), b_stack.float(), slots.cpu())
    assert max_error(out, want) <= tolerance
    base = slots < 0
    assert torch.equal(out[base], before[base]) and not h[base].any()
