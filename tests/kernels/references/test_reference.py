"""The reference kernels against naive math written out independently here."""

import math

import pytest
import torch

from xinserve.kernels.attention_metadata import DecodeGather, build_decode_gather
from xinserve.kernels.references import dense as ref

NUM_BLOCKS, BLOCK_SIZE, KVH, H, D = 24, 4, 2, 6, 8  # GQA: 3 query heads per KV head


def naive_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """q: [q_len, H, D] at the last q_len positions of k, v: [L, KVH, D]; explicit causal softmax,
    over the last ``window`` positions up to each query when given."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    out = torch.zeros_like(q, dtype=torch.float64)
    for h in range(num_heads):
        kv_h = h // (num_heads // num_kv_heads)
        for j in range(q_len):
            position = seq_len - q_len + j
            visible = range(0 if window is None else max(0, position - window + 1), position + 1)
            scores = [scale * float(q[j, h].double() @ k[t, kv_h].double()) for t in visible]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            for t, w in zip(visible, weights):
                out[j, h] += (w / total) * v[t, kv_h].double()
    return out.to(q.dtype)


def fill_paged(contexts: list[torch.Tensor], block_ids: list[list[int]]) -> torch.Tensor:
    """Place each sequence's [L, KVH, D] context into a fresh cache at the given (scrambled) blocks."""
    cache = torch.randn(NUM_BLOCKS, BLOCK_SIZE, KVH, D)  # garbage outside the sequences' slots
    for ctx, blocks in zip(contexts, block_ids):
        for t in range(ctx.shape[0]):
            cache[blocks[t // BLOCK_SIZE], t % BLOCK_SIZE] = ctx[t]
    return cache


def block_table(block_ids: list[list[int]]) -> torch.Tensor:
    width = max(len(b) for b in block_ids)
    return torch.tensor([b + [0] * (width - len(b)) for b in block_ids], dtype=torch.int32)


def test_write_kv_places_each_token_at_its_slot() -> None:
    torch.manual_seed(0)
    key, value = torch.randn(5, KVH, D), torch.randn(5, KVH, D)
    key_cache, value_cache = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KVH, D), torch.zeros(NUM_BLOCKS, BLOCK_SIZE, KVH, D)
    slots = [17 * BLOCK_SIZE + 3, 2 * BLOCK_SIZE, 2 * BLOCK_SIZE + 1, 9 * BLOCK_SIZE + 2, 0]
    ref.write_kv(key, value, key_cache, value_cache, torch.tensor(slots, dtype=torch.int64))
    for t, slot in enumerate(slots):
        assert torch.equal(key_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE], key[t])
        assert torch.equal(value_cache[slot // BLOCK_SIZE, slot % BLOCK_SIZE], value[t])
    assert int((key_cache.abs().sum(dim=(-1, -2)) != 0).sum()) == len(slots)


def test_write_kv_into_a_layer_view_of_the_shared_cache() -> None:
    kv_cache = torch.zeros(2, 3, NUM_BLOCKS, BLOCK_SIZE, KVH, D)  # [2, layers, N, BS, KVH, D]
    key, value = torch.ones(1, KVH, D), torch.full((1, KVH, D), 2.0)
    ref.write_kv(key, value, kv_cache[0, 1], kv_cache[1, 1], torch.tensor([5]))
    assert torch.equal(kv_cache[0, 1, 1, 1], key[0]) and torch.equal(kv_cache[1, 1, 1, 1], value[0])
    assert float(kv_cache.sum()) == float(key.sum() + value.sum())


def decode(query, key_cache, value_cache, tables, lens, scale):
    """The reference decode with the runner's gather plan built from host copies."""
    gather = build_decode_gather(tables.numpy(), lens.numpy(), key_cache.shape[1], torch.device("cpu"))
    return ref.paged_decode_attention(query, key_cache, value_cache, tables, lens, scale, gather)


def test_paged_decode_attention_mixed_lengths_gqa_scrambled_blocks() -> None:
    torch.manual_seed(1)
    seq_lens = [1, 7, 13]
    block_ids = [[5], [19, 3], [8, 22, 1, 14]]
    keys = [torch.randn(n, KVH, D) for n in seq_lens]
    values = [torch.randn(n, KVH, D) for n in seq_lens]
    key_cache, value_cache = fill_paged(keys, block_ids), fill_paged(values, block_ids)
    query = torch.randn(len(seq_lens), H, D)
    scale = D**-0.5
    out = decode(query, key_cache, value_cache, block_table(block_ids), torch.tensor(seq_lens, dtype=torch.int32),
                 scale)
    assert out.shape == (len(seq_lens), H, D)
    for i in range(len(seq_lens)):
        expected = naive_attention(query[i : i + 1], keys[i], values[i], scale)
        torch.testing.assert_close(out[i : i + 1], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seq_lens", [[7, 13, 2], [9, 9, 9]])
def test_gather_plan_needs_only_the_longest_context(seq_lens: list[int]) -> None:
    """The plan gathers only the blocks the longest context needs (the table is padded wider), with
    no mask when all lengths are equal, and gives the same attention as a plan over every block."""
    torch.manual_seed(8)
    block_ids = [[5, 19, 3, 0], [8, 22, 1, 14], [11, 0, 0, 0]]  # padded wider than any context needs
    key_cache, value_cache = (torch.randn(NUM_BLOCKS, BLOCK_SIZE, KVH, D) for _ in range(2))
    query = torch.randn(len(seq_lens), H, D)
    tables, lens = block_table(block_ids), torch.tensor(seq_lens, dtype=torch.int32)
    plan = build_decode_gather(tables.numpy(), lens.numpy(), BLOCK_SIZE, torch.device("cpu"))
    assert plan.block_ids.numel() == len(seq_lens) * -(-max(seq_lens) // BLOCK_SIZE)
    assert (plan.mask is None) == (len(set(seq_lens)) == 1)
    width = tables.shape[1] * BLOCK_SIZE
    full_mask = (torch.arange(width)[None, :] < lens[:, None]).view(len(seq_lens), 1, 1, width)
    full = DecodeGather(tables.reshape(-1).long(), width, full_mask)
    expected = ref.paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.4, full)
    out = ref.paged_decode_attention(query, key_cache, value_cache, tables, lens, 0.4, plan)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_prefill_attention_with_and_without_cached_prefix(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    seq_lens = [6, 11, 9]  # context after this step
    q_lens = [6, 4, 1]  # first has no prefix; the others follow a cached prefix
    block_ids = [[4, 17], [11, 2, 20], [9, 0, 13]]
    keys = [torch.randn(n, KVH, D, dtype=dtype) for n in seq_lens]
    values = [torch.randn(n, KVH, D, dtype=dtype) for n in seq_lens]
    key_cache = fill_paged(keys, block_ids).to(dtype)
    value_cache = fill_paged(values, block_ids).to(dtype)
    query = torch.randn(sum(q_lens), H, D, dtype=dtype)
    start_loc = [0, 6, 10, 11]
    scale = 0.3
    out = ref.paged_prefill_attention(
        query, key_cache, value_cache, block_table(block_ids), start_loc, seq_lens, scale
    )
    assert out.shape == query.shape and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for i in range(len(seq_lens)):
        q = query[start_loc[i] : start_loc[i + 1]]
        expected = naive_attention(q.float(), keys[i].float(), values[i].float(), scale)
        torch.testing.assert_close(out[start_loc[i] : start_loc[i + 1]].float(), expected, atol=tol, rtol=tol)


def test_decode_equals_last_row_of_prefill() -> None:
    torch.manual_seed(3)
    block_ids = [[6, 2, 15]]
    keys, values = [torch.randn(10, KVH, D)], [torch.randn(10, KVH, D)]
    key_cache, value_cache = fill_paged(keys, block_ids), fill_paged(values, block_ids)
    query = torch.randn(1, H, D)
    tables = block_table(block_ids)
    decoded = decode(query, key_cache, value_cache, tables, torch.tensor([10]), 0.5)
    prefill = ref.paged_prefill_attention(query, key_cache, value_cache, tables, [0, 1], [10], 0.5)
    torch.testing.assert_close(decoded, prefill, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("window", [1, 5, 12])
def test_sliding_window_prefill_and_decode_see_only_the_last_window_positions(window: int) -> None:
    """Window 5 cuts every context here but the shortest, at block boundaries and inside blocks;
    window 12 only the longest; window 1 leaves each token alone with itself."""
    torch.manual_seed(9)
    seq_lens, q_lens = [6, 11, 13], [6, 4, 1]  # a whole prompt, then chunks after cached prefixes
    block_ids = [[4, 17], [11, 2, 20], [9, 0, 13, 21]]
    keys = [torch.randn(n, KVH, D) for n in seq_lens]
    values = [torch.randn(n, KVH, D) for n in seq_lens]
    key_cache, value_cache = fill_paged(keys, block_ids), fill_paged(values, block_ids)
    tables, scale = block_table(block_ids), 0.4
    query = torch.randn(sum(q_lens), H, D)
    start_loc = [0, 6, 10, 11]
    out = ref.paged_prefill_attention(query, key_cache, value_cache, tables, start_loc, seq_lens, scale,
                                      sliding_window=window)
    for i in range(len(seq_lens)):
        q = query[start_loc[i] : start_loc[i + 1]]
        expected = naive_attention(q, keys[i], values[i], scale, window)
        torch.testing.assert_close(out[start_loc[i] : start_loc[i + 1]], expected, atol=1e-5, rtol=1e-5)
    one_token = torch.randn(len(seq_lens), H, D)
    gather = build_decode_gather(tables.numpy(), torch.tensor(seq_lens).numpy(), BLOCK_SIZE, torch.device("cpu"))
    decoded = ref.paged_decode_attention(one_token, key_cache, value_cache, tables,
                                         torch.tensor(seq_lens, dtype=torch.int32), scale, gather, sliding_window=window)
    for i in range(len(seq_lens)):
        expected = naive_attention(one_token[i : i + 1], keys[i], values[i], scale, window)
        torch.testing.assert_close(decoded[i : i + 1], expected, atol=1e-5, rtol=1e-5)


def test_rms_norm_plain_and_fused_residual() -> None:
    torch.manual_seed(4)
    x, residual, weight = torch.randn(3, 5, 16), torch.randn(3, 5, 16), torch.randn(16)
    eps = 1e-5
    expected = torch.empty_like(x)
    for idx in range(15):
        row = x.view(15, 16)[idx].double()
        rms = math.sqrt(float((row**2).sum()) / 16 + eps)
        expected.view(15, 16)[idx] = (row / rms * weight.double()).float()
    torch.testing.assert_close(ref.rms_norm(x, weight, eps), expected, atol=1e-5, rtol=1e-5)

    normed, new_residual = ref.rms_norm(x, weight, eps, residual=residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, ref.rms_norm(x + residual, weight, eps))
    assert not torch.allclose(normed, expected)


def test_rms_norm_keeps_dtype() -> None:
    x = torch.randn(4, 32, dtype=torch.bfloat16) * 100
    out = ref.rms_norm(x, torch.ones(32, dtype=torch.bfloat16), 1e-6)
    assert out.dtype == torch.bfloat16
    rms = out.float().pow(2).mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(4), atol=1e-2, rtol=1e-2)


def naive_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, is_neox: bool) -> torch.Tensor:
    """Rotate pairs of x: [T, heads, D] by complex multiplication; dims past 2 * len(inv_freq) untouched."""
    half = inv_freq.shape[0]
    rotary_dim = 2 * half
    out = x.clone()
    for t in range(x.shape[0]):
        turn = torch.polar(torch.ones(half, dtype=torch.float64), positions[t].double() * inv_freq.double())
        if is_neox:
            first, second = x[t, :, :half].double(), x[t, :, half:rotary_dim].double()
        else:
            first, second = x[t, :, 0:rotary_dim:2].double(), x[t, :, 1:rotary_dim:2].double()
        z = torch.complex(first, second) * turn
        if is_neox:
            out[t, :, :half], out[t, :, half:rotary_dim] = z.real.float(), z.imag.float()
        else:
            out[t, :, 0:rotary_dim:2], out[t, :, 1:rotary_dim:2] = z.real.float(), z.imag.float()
    return out


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [D, D // 2])
def test_rotary_embedding_matches_complex_rotation(is_neox: bool, rotary_dim: int) -> None:
    torch.manual_seed(5)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    angles = torch.arange(64).float()[:, None] * inv_freq[None, :]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)  # [64, rotary_dim]
    positions = torch.tensor([0, 3, 17, 63, 5])
    query, key = torch.randn(5, H, D), torch.randn(5, KVH, D)
    q_out, k_out = ref.rotary_embedding(query, key, ref.rotary_cos_sin(positions, cache, is_neox, query.dtype), is_neox)
    torch.testing.assert_close(q_out, naive_rope(query, positions, inv_freq, is_neox), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, naive_rope(key, positions, inv_freq, is_neox), atol=1e-5, rtol=1e-5)
    assert torch.equal(q_out[..., rotary_dim:], query[..., rotary_dim:])
    assert torch.equal(q_out[0], query[0])  # position 0 is the identity rotation
    assert not torch.allclose(q_out[1], query[1])


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_table_layout(is_neox: bool) -> None:
    cache = torch.randn(32, 8)
    cos_sin = ref.rotary_cos_sin(torch.tensor([4, 0, 31]), cache, is_neox, torch.float32)
    assert cos_sin.shape == (2, 3, 1, 8)
    cos, sin = cache[4].chunk(2)
    assert torch.equal(cos_sin[0, 0, 0], torch.cat((cos, cos)) if is_neox else cos.repeat_interleave(2))
    assert torch.equal(cos_sin[1, 0, 0], torch.cat((-sin, sin)) if is_neox else torch.stack((-sin, sin), -1).flatten())


def test_rotary_styles_differ() -> None:
    torch.manual_seed(6)
    angles = torch.arange(8).float()[:, None] * torch.tensor([1.0, 0.1])[None, :]
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    query, key = torch.randn(2, H, 4), torch.randn(2, KVH, 4)
    positions = torch.tensor([3, 5])
    neox, _ = ref.rotary_embedding(query, key, ref.rotary_cos_sin(positions, cache, True, query.dtype), True)
    interleaved, _ = ref.rotary_embedding(query, key, ref.rotary_cos_sin(positions, cache, False, query.dtype), False)
    assert not torch.allclose(neox, interleaved)


def test_silu_and_mul() -> None:
    torch.manual_seed(7)
    x = torch.randn(3, 10)
    gate, up = x[:, :5], x[:, 5:]
    expected = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(ref.silu_and_mul(x), expected)
