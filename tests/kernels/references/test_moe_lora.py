"""``fused_moe_lora`` (the routed experts with each row's adapter) against per-token math written out here:
each (token, expert) row gets its slot's expert delta inside the SwiGLU; base rows (slot -1) equal
``fused_moe`` exactly; under torch.compile it is one opaque op with the same result."""

import torch
import torch.nn.functional as F

from xinserve.kernels.references.dense import fused_moe
from xinserve.kernels.references.moe_lora import fused_moe_lora

T, HD, INTER, E, K, S, R = 7, 16, 8, 4, 2, 2, 3


def inputs(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.3

    hidden, w13, w2 = rand(T, HD), rand(E, 2 * INTER, HD), rand(E, HD, INTER)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])  # [T, K]
    weights = torch.rand(T, K, generator=gen)
    stacks = (rand(S, E, R, HD), rand(S, E, 2 * INTER, R), rand(S, E, R, INTER), rand(S, E, HD, R))
    slots = torch.tensor([0, -1, 1, 1, -1, 0, 1])
    return hidden, w13, w2, weights, ids, stacks, slots


def per_token(hidden, w13, w2, weights, ids, stacks, slots) -> torch.Tensor:
    a13, b13, a2, b2 = stacks
    out = torch.zeros_like(hidden)
    for t in range(T):
        s = int(slots[t])
        for k in range(K):
            e, x = int(ids[t, k]), hidden[t]
            w13_e = w13[e] + (b13[s, e] @ a13[s, e] if s >= 0 else 0)
            w2_e = w2[e] + (b2[s, e] @ a2[s, e] if s >= 0 else 0)
            gate, up = (w13_e @ x).chunk(2)
            out[t] += weights[t, k] * (w2_e @ (F.silu(gate) * up))
    return out


def test_each_row_gets_its_slots_expert_delta_and_base_rows_equal_fused_moe():
    hidden, w13, w2, weights, ids, stacks, slots = inputs()
    out = fused_moe_lora(hidden, w13, w2, weights, ids, *stacks, slots)
    torch.testing.assert_close(out, per_token(hidden, w13, w2, weights, ids, stacks, slots), atol=1e-5, rtol=1e-5)
    base = fused_moe(hidden, w13, w2, weights, ids)
    assert torch.equal(out[slots < 0], base[slots < 0])
    assert not torch.allclose(out[slots >= 0], base[slots >= 0], atol=1e-3)


def test_compiled_it_is_one_opaque_op_with_the_same_result():
    hidden, w13, w2, weights, ids, stacks, slots = inputs(seed=1)
    compiled = torch.compile(fused_moe_lora, fullgraph=True, backend="eager")  # no graph break: an opaque op
    torch.testing.assert_close(compiled(hidden, w13, w2, weights, ids, *stacks, slots),
                               fused_moe_lora(hidden, w13, w2, weights, ids, *stacks, slots))
