"""The LoRA reference ops (kernels/references/lora.py) against a naive loop over rows: each row's
x @ A[slot]^T @ B[slot]^T added to its output, base rows (-1) left exactly as they were."""

import torch

from xinserve.kernels.references.lora import lora_expand, lora_shrink


def naive(x, out, a_stack, b_stack, slots):
    expected = out.clone()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected[t] += (x[t] @ a_stack[slot].t()) @ b_stack[slot].t()
    return expected


def test_shrink_then_expand_equal_a_per_row_loop_with_base_rows_unchanged():
    gen = torch.Generator().manual_seed(0)
    tokens, slots_n, rank, d_in, d_out = 9, 3, 8, 24, 40
    x = torch.randn(tokens, d_in, generator=gen)
    a_stack = torch.randn(slots_n, rank, d_in, generator=gen)
    b_stack = torch.randn(slots_n, d_out, rank, generator=gen)
    out = torch.randn(tokens, d_out, generator=gen)
    slots = torch.tensor([0, -1, 2, 1, 1, -1, 0, 2, -1])
    expected = naive(x, out, a_stack, b_stack, slots)
    h = lora_shrink(x, a_stack, slots)
    assert h.shape == (tokens, rank)
    assert torch.equal(h[slots == -1], torch.zeros(3, rank))
    result = lora_expand(out.clone(), h, b_stack, slots)
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(result[slots == -1], out[slots == -1])


def test_expand_adds_in_place_and_a_zero_padded_rank_adds_nothing():
    gen = torch.Generator().manual_seed(1)
    x, out = torch.randn(4, 16, generator=gen), torch.randn(4, 12, generator=gen)
    a, b = torch.randn(2, 4, 16, generator=gen), torch.randn(2, 12, 4, generator=gen)
    padded_a = torch.cat([a, torch.zeros(2, 4, 16)], dim=1)  # rank 4 padded to 8
    padded_b = torch.cat([b, torch.zeros(2, 12, 4)], dim=2)
    slots = torch.tensor([1, 0, -1, 1])
    target = out.clone()
    returned = lora_expand(target, lora_shrink(x, padded_a, slots), padded_b, slots)
    assert returned is target
    torch.testing.assert_close(target, naive(x, out, a, b, slots), rtol=1e-5, atol=1e-5)
