"""Triton varlen prefill attention over the paged KV cache, after a cached prefix.

Sequence i's q_len queries sit at absolute positions [prefix, seq_len), prefix = seq_len - q_len,
and query j sees keys [0, prefix + j] (causal, chunked prefill). Grid (query tiles, KVH, P):
program (t, h, i) takes ROWS_TILE // G consecutive queries of sequence i times the G query heads
that share KV head h as the rows of one tile (row r: query r // G, head r % G), so each K/V tile
read from the cache serves the whole group. It runs an online softmax over the keys [0, the
tile's last query position], KEYS_TILE at a time, each key's block taken from the block table.
"""

import itertools
import math

import torch

import triton
import triton.language as tl
from xinserve.kernels.triton import common
from xinserve.kernels.triton.common import interpreted, keys_tile, load_kv_tile, online_softmax_step, tile

# (query, head) rows per program; keys per inner step (fewer when the tiles are wide: keys_tile)
ROWS_TILE, KEYS_TILE = 64, 64


@triton.jit
def _prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, query_start_ptr, seq_lens_ptr, out_ptr,
    q_stride_t, q_stride_h, q_stride_d,
    cache_stride_n, cache_stride_bs, cache_stride_h, cache_stride_d,
    bt_stride_s, bt_stride_b,
    out_stride_t, out_stride_h, out_stride_d,
    qk_scale, group, queries_per_tile, head_dim,
    BLOCK_SIZE: tl.constexpr, ROWS_TILE: tl.constexpr, DIM_TILE: tl.constexpr, KEYS_TILE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    q_tile, kv_head, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    first = q_tile * queries_per_tile
    if first >= q_len:  # the grid covers the longest sequence's queries; this one has fewer
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    rows = tl.arange(0, ROWS_TILE)
    dims = tl.arange(0, DIM_TILE)
    queries = first + rows // group  # [ROWS_TILE] index among the sequence's queries
    heads = kv_head * group + rows % group
    row_mask = (rows < queries_per_tile * group) & (queries < q_len)
    dim_mask = dims < head_dim
    row_dim_mask = row_mask[:, None] & dim_mask[None, :]
    q_offsets = (q_start + queries)[:, None] * q_stride_t + heads[:, None] * q_stride_h
    q = tl.load(query_ptr + q_offsets + dims[None, :] * q_stride_d, mask=row_dim_mask, other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    positions = prefix + queries  # a row sees keys [0, position]; every row sees key 0
    key_end = tl.minimum(seq_len, prefix + first + queries_per_tile)  # past the tile's last query

    # online softmax in base 2 (qk_scale includes log2(e)): running max, sum and unnormalised output
    row_max = tl.full([ROWS_TILE], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS_TILE], tl.float32)
    acc = tl.zeros([ROWS_TILE, DIM_TILE], tl.float32)
    for key_start in range(0, key_end, KEYS_TILE):
        keys = key_start + tl.arange(0, KEYS_TILE)
        key_mask = keys < key_end
        k, v = load_kv_tile(  # [KEYS_TILE, DIM_TILE]
            key_cache_ptr, value_cache_ptr, kv_head, block_tables_ptr + seq * bt_stride_s, keys, key_mask, dims,
            dim_mask, cache_stride_n, cache_stride_bs, cache_stride_h, cache_stride_d, bt_stride_b, BLOCK_SIZE, DOT_F32,
        )
        visible = key_mask[None, :] & (keys[None, :] <= positions[:, None])  # the first tile holds key 0
        row_max, row_sum, acc = online_softmax_step(q, k, v, visible, qk_scale, row_max, row_sum, acc)

    out = acc / row_sum[:, None]
    out_ptrs = out_ptr + (q_start + queries)[:, None] * out_stride_t + heads[:, None] * out_stride_h
    tl.store(out_ptrs + dims[None, :] * out_stride_d, out.to(out_ptr.dtype.element_ty), mask=row_dim_mask)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                            scale: float) -> torch.Tensor:
    """``xinserve.kernels.references.dense.paged_prefill_attention`` in Triton. query: [T, H, D]; key_cache,
    value_cache: [N, BS, KVH, D] (already holding the new tokens); block_tables: [P, B] int32;
    query_start_loc: P + 1 host offsets from 0; seq_lens: P host context lengths. Returns [T, H, D]."""
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_seqs = len(seq_lens)
    if num_seqs == 0 or query.shape[0] == 0:
        return out
    rows_tile = max(ROWS_TILE, tile(group))
    queries_per_tile = rows_tile // group
    max_q_len = max(end - start for start, end in itertools.pairwise(query_start_loc))
    # One host-to-device copy for both lists: offsets [P + 1], padded to a multiple of 4 entries, then
    # lengths [P]. The padding keeps the lengths' pointer 16-byte aligned whatever P is: Triton compiles a
    # variant per pointer alignment, and without it a batch of P = 3, 7, 11... prefills compiled a second
    # one mid-serving (about a second, once per process: it was charged to the first run that met it).
    offsets = [*query_start_loc, *[query_start_loc[-1]] * (-(num_seqs + 1) % 4)]
    lengths = torch.tensor([*offsets, *seq_lens], dtype=torch.int32, device=query.device)
    _prefill_kernel[(triton.cdiv(max_q_len, queries_per_tile), num_kv_heads, num_seqs)](
        query, key_cache, value_cache, block_tables, lengths, lengths[len(offsets) :], out,
        *query.stride(), *common.cache_strides(key_cache, value_cache), *block_tables.stride(), *out.stride(),
        scale * math.log2(math.e), group, queries_per_tile, head_dim,
        BLOCK_SIZE=block_size,
        ROWS_TILE=rows_tile,
        DIM_TILE=tile(head_dim),
        KEYS_TILE=keys_tile(KEYS_TILE, tile(head_dim), key_cache),
        DOT_F32=interpreted(_prefill_kernel),
    )
    return out
