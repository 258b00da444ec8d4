"""Triton paged decode attention: flash-decoding over the paged KV cache, read in place.

One query token per sequence attends to its whole cached context. Grid (S, KVH, splits): program
(s, h, p) takes the G query heads that share KV head h as the rows of one tile (GQA without
repeating K/V) and runs an online softmax over tokens [p * split_len, (p + 1) * split_len) of
sequence s, TOKENS_TILE tokens at a time. Each token's block comes from the block table, so a tile
may span several cache blocks (BS 16) or part of one (BS 128). With one split the program writes
the output; with several (long contexts, few sequences) each writes a partial result and
``_combine_splits_kernel`` merges the splits of every (sequence, query head).
"""

import math
from typing import TYPE_CHECKING

import torch

import triton
import triton.language as tl
from xinserve.kernels.triton import common
from xinserve.kernels.triton.common import interpreted, keys_tile, load_kv_tile, online_softmax_step, tile

if TYPE_CHECKING:
    from xinserve.kernels.attention_metadata import DecodeGather

TOKENS_TILE = 64  # keys per inner step, a [64, D] K and V tile (fewer when they are wide: keys_tile)
# Split a context so that S * KVH * splits programs fill a large GPU, but into at most MAX_SPLITS
# splits (a power of two: the combine kernel holds them all in one tile); each sequence's own length
# sets its split length (``_split_len``).
TARGET_PROGRAMS, MAX_SPLITS = 512, 32


@triton.jit
def _split_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, partial_out_ptr, partial_lse_ptr,
    q_stride_s, q_stride_h, q_stride_d,
    cache_stride_n, cache_stride_bs, cache_stride_h, cache_stride_d,
    bt_stride_s, bt_stride_b,
    out_stride_s, out_stride_h, out_stride_d,
    po_stride_s, po_stride_h, po_stride_p, po_stride_d,
    lse_stride_s, lse_stride_h, lse_stride_p,
    qk_scale, split_len, num_splits, group, head_dim,
    BLOCK_SIZE: tl.constexpr, GROUP_TILE: tl.constexpr, DIM_TILE: tl.constexpr, TOKENS_TILE: tl.constexpr,
    ONE_SPLIT: tl.constexpr, SPLIT_BY_LEN: tl.constexpr, DOT_F32: tl.constexpr,
):
    seq, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, split_len, num_splits, TOKENS_TILE, SPLIT_BY_LEN)
    start = split * split_len
    if start >= seq_len:  # the grid covers the widest block table; this context is shorter
        return
    end = tl.minimum(start + split_len, seq_len)

    rows = tl.arange(0, GROUP_TILE)  # row g is query head kv_head * G + g
    dims = tl.arange(0, DIM_TILE)
    heads = kv_head * group + rows
    dim_mask = dims < head_dim
    row_dim_mask = (rows < group)[:, None] & dim_mask[None, :]
    q = tl.load(  # [GROUP_TILE, DIM_TILE]; padding rows and dims are 0
        query_ptr + seq * q_stride_s + heads[:, None] * q_stride_h + dims[None, :] * q_stride_d,
        mask=row_dim_mask, other=0.0,
    )
    if DOT_F32:
        q = q.to(tl.float32)

    # online softmax in base 2 (qk_scale includes log2(e)): running max, sum and unnormalised output
    row_max = tl.full([GROUP_TILE], float("-inf"), tl.float32)
    row_sum = tl.zeros([GROUP_TILE], tl.float32)
    acc = tl.zeros([GROUP_TILE, DIM_TILE], tl.float32)
    for tile_start in range(start, end, TOKENS_TILE):
        tokens = tile_start + tl.arange(0, TOKENS_TILE)
        token_mask = tokens < end
        k, v = load_kv_tile(  # [TOKENS_TILE, DIM_TILE]
            key_cache_ptr, value_cache_ptr, kv_head, block_tables_ptr + seq * bt_stride_s, tokens, token_mask, dims,
            dim_mask, cache_stride_n, cache_stride_bs, cache_stride_h, cache_stride_d, bt_stride_b, BLOCK_SIZE, DOT_F32,
        )
        # the first tile's first token is always in range
        row_max, row_sum, acc = online_softmax_step(q, k, v, token_mask[None, :], qk_scale, row_max, row_sum, acc)

    if ONE_SPLIT:
        out = acc / row_sum[:, None]
        out_ptrs = out_ptr + seq * out_stride_s + heads[:, None] * out_stride_h
        tl.store(out_ptrs + dims[None, :] * out_stride_d, out.to(out_ptr.dtype.element_ty), mask=row_dim_mask)
    else:
        # the split's own normalised output, and log2 of its softmax sum in the global frame
        partial_ptrs = partial_out_ptr + seq * po_stride_s + split * po_stride_p
        partial_ptrs += heads[:, None] * po_stride_h + dims[None, :] * po_stride_d
        tl.store(partial_ptrs, acc / row_sum[:, None], mask=row_dim_mask)
        lse_ptrs = partial_lse_ptr + seq * lse_stride_s + heads * lse_stride_h + split * lse_stride_p
        tl.store(lse_ptrs, row_max + tl.log2(row_sum), mask=rows < group)


@triton.jit
def _split_len(seq_len, split_len, num_splits, TOKENS_TILE: tl.constexpr, SPLIT_BY_LEN: tl.constexpr):
    """Tokens per split of this sequence: with SPLIT_BY_LEN its own context (read on the device) cut into
    num_splits whole tiles, so a short context, a decode bucket's padding row among them, takes few
    programs however wide the table is; else the caller's fixed ``split_len``."""
    if SPLIT_BY_LEN:
        split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), TOKENS_TILE) * TOKENS_TILE
    return split_len


@triton.jit
def _combine_splits_kernel(
    partial_out_ptr, partial_lse_ptr, seq_lens_ptr, out_ptr,
    po_stride_s, po_stride_h, po_stride_p, po_stride_d,
    lse_stride_s, lse_stride_h, lse_stride_p,
    out_stride_s, out_stride_h, out_stride_d,
    split_len, num_splits, head_dim,
    SPLITS_TILE: tl.constexpr, DIM_TILE: tl.constexpr, TOKENS_TILE: tl.constexpr, SPLIT_BY_LEN: tl.constexpr,
):
    seq, head = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = _split_len(seq_len, split_len, num_splits, TOKENS_TILE, SPLIT_BY_LEN)
    splits = tl.arange(0, SPLITS_TILE)
    dims = tl.arange(0, DIM_TILE)
    ran = (splits < num_splits) & (splits * split_len < seq_len)  # the splits that wrote a partial
    lse = tl.load(  # [SPLITS_TILE]
        partial_lse_ptr + seq * lse_stride_s + head * lse_stride_h + splits * lse_stride_p,
        mask=ran, other=float("-inf"),
    )
    weights = tl.exp2(lse - tl.max(lse, 0))  # each split's share of the softmax sum, up to a factor
    partial = tl.load(  # [SPLITS_TILE, DIM_TILE]
        partial_out_ptr + seq * po_stride_s + head * po_stride_h
        + splits[:, None] * po_stride_p + dims[None, :] * po_stride_d,
        mask=ran[:, None] & (dims < head_dim)[None, :], other=0.0,
    )
    out = tl.sum(weights[:, None] * partial, 0) / tl.sum(weights, 0)  # [DIM_TILE]
    tl.store(
        out_ptr + seq * out_stride_s + head * out_stride_h + dims * out_stride_d,
        out.to(out_ptr.dtype.element_ty), mask=dims < head_dim,
    )


def default_num_splits(max_len: int, num_seqs: int, num_kv_heads: int) -> int:
    """Splits per context for a table of max_len tokens: one when S * KVH programs already fill the
    device, else enough to reach TARGET_PROGRAMS, at most MAX_SPLITS and at most a tile each."""
    return max(1, min(MAX_SPLITS, triton.cdiv(TARGET_PROGRAMS, num_seqs * num_kv_heads),
                      triton.cdiv(max_len, TOKENS_TILE)))


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           gather: "DecodeGather | None" = None, *,
                           split_len: int | None = None) -> torch.Tensor:
    """``xinserve.kernels.references.dense.paged_decode_attention`` in Triton. query: [S, H, D]; key_cache,
    value_cache: [N, BS, KVH, D]; block_tables: [S, B] int32; seq_lens: [S] int32. Returns [S, H, D].

    ``gather`` (the reference's gather plan) is accepted for the shared signature and not read: the
    kernel walks the block table itself. The number of splits follows the table width B * BS and the
    batch (``default_num_splits``), not the lengths: those are on the device, and reading them would
    sync. Each sequence then cuts its own context into that many splits on the device, so a captured
    decode bucket, whose table spans max_model_len, splits a short context as finely as an eager step
    does (a split length fixed from the width would leave one program walking it all, and a graph
    freezes that choice). ``split_len``: a fixed number of tokens per split instead (raised if it would
    make more than MAX_SPLITS).
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    group = num_heads // num_kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    max_len = block_tables.shape[1] * block_size
    tokens_tile = keys_tile(TOKENS_TILE, tile(head_dim), key_cache)
    if split_len is None:
        num_splits = default_num_splits(max_len, num_seqs, num_kv_heads)
        split_len = max_len if num_splits == 1 else 0  # 0: each sequence's own (SPLIT_BY_LEN)
    else:
        split_len = max(split_len, triton.cdiv(max_len, MAX_SPLITS))
        num_splits = triton.cdiv(max_len, split_len)
    by_len = split_len == 0
    if num_splits > 1:
        # partial_out: [S, H, splits, D] fp32; partial_lse: [S, H, splits] fp32
        partial_out = query.new_empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32)
        partial_lse = query.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    else:  # not read: ONE_SPLIT compiles the partial stores away
        partial_out, partial_lse = out.unsqueeze(2), out[..., 0].unsqueeze(2)
    _split_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens,
        out, partial_out, partial_lse,
        *query.stride(), *common.cache_strides(key_cache, value_cache), *block_tables.stride(),
        *out.stride(), *partial_out.stride(), *partial_lse.stride(),
        scale * math.log2(math.e), split_len, num_splits, group, head_dim,
        BLOCK_SIZE=block_size,
        GROUP_TILE=tile(group),
        DIM_TILE=tile(head_dim),
        TOKENS_TILE=tokens_tile,
        ONE_SPLIT=num_splits == 1,
        SPLIT_BY_LEN=by_len,
        DOT_F32=interpreted(_split_attention_kernel),
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_seqs, num_heads)](
            partial_out, partial_lse, seq_lens, out,
            *partial_out.stride(), *partial_lse.stride(), *out.stride(),
            split_len, num_splits, head_dim,
            SPLITS_TILE=MAX_SPLITS,  # fixed, so a new split count does not compile a new variant
            DIM_TILE=triton.next_power_of_2(head_dim),
            TOKENS_TILE=tokens_tile,
            SPLIT_BY_LEN=by_len,
        )
    return out
