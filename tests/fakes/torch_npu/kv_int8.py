"""FAKE of ``npu_fused_infer_attention_score``'s int8 KV ("C8") decode form, for tests only: one query
token per batch (BSND, Q_S = 1), PageAttention over int8 key and value blocks, and KV antiquant mode 5
("per-token叠加per head并使用page attention模式管理scale"): a float32 scale per token and KV head, held as
pages [blocknum, KV_N, blocksize] beside the blocks and read through the same block table.

What it checks, from the torch_npu documentation of the operator: query float16 / bfloat16 [B, 1, N, D];
key and value int8 [blocknum, blocksize, KV_N * D], contiguous, of one shape; both antiquant modes 5
with float32 scales [blocknum, KV_N, blocksize] of one shape; block_size a multiple of 32 (int8 pages);
N <= 256, N / KV_N a whole number <= 64, D <= 512; block_table [B, M] int32; one context length per
batch, within the table. Symmetric only (no offsets), as the caller uses it. Computes
softmax(scale * q k^T) v with k, v = codes * scale in float32, cast to the query's dtype.
"""

import numpy as np
import torch

from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.references import dense as reference

_HALF = (torch.float16, torch.bfloat16)
PER_TOKEN_HEAD_PAGED = 5


def _check(ok: bool, detail: str) -> None:
    if not ok:  # 161002: ACLNN_ERR_PARAM_INVALID
        raise RuntimeError(f"call aclnnFusedInferAttentionScore failed, error code 161002: {detail}")


def antiquant_paged_decode(query, key, value, *, key_antiquant_scale, value_antiquant_scale, key_antiquant_offset,
                           value_antiquant_offset, key_antiquant_mode, value_antiquant_mode, block_table,
                           actual_seq_lengths_kv, num_heads, num_key_value_heads, scale, input_layout, block_size):
    """Returns (attention_out [B, 1, N, D] in the query's dtype, an empty softmax_lse)."""
    if input_layout != "BSND" or key_antiquant_offset is not None or value_antiquant_offset is not None:
        raise NotImplementedError("the fake models the int8 KV decode form in BSND, symmetric (no offsets), only")
    if (key_antiquant_mode, value_antiquant_mode) != (PER_TOKEN_HEAD_PAGED,) * 2:
        raise NotImplementedError("the fake models key/value_antiquant_mode 5 (per token and head, paged) only")
    _check(block_table is not None, "page attention needs a block_table")
    _check(query.dim() == 4 and query.dtype in _HALF and query.is_contiguous(), f"query must be a contiguous "
           f"[B, S, N, D] float16 / bfloat16 tensor, got {query.dtype}{tuple(query.shape)}")
    batch, q_len, heads, head_dim = query.shape
    _check(q_len == 1, "page attention does not support antiquant (伪量化) with more than one query token")
    kv_heads = num_key_value_heads or num_heads
    _check(heads == num_heads <= 256 and num_heads % kv_heads == 0 and num_heads // kv_heads <= 64,
           f"num_heads {num_heads} / num_key_value_heads {kv_heads} unsupported for query {tuple(query.shape)}")
    _check(head_dim <= 512, f"head dim {head_dim} > 512")
    _check(block_size > 0 and block_size % 32 == 0, f"block_size {block_size} must be 32-aligned for int8 pages")
    for name, t in (("key", key), ("value", value)):
        _check(t.dtype == torch.int8 and t.is_contiguous(), f"{name} must be contiguous int8, got {t.dtype}")
        _check(t.dim() == 3 and tuple(t.shape[1:]) == (block_size, kv_heads * head_dim),
               f"{name} {tuple(t.shape)} is not [blocknum, {block_size}, {kv_heads * head_dim}]")
    _check(key.shape == value.shape, "key and value shapes differ")
    num_blocks = key.shape[0]
    for name, t in (("key_antiquant_scale", key_antiquant_scale), ("value_antiquant_scale", value_antiquant_scale)):
        _check(t is not None and t.dtype == torch.float32 and t.is_contiguous()
               and tuple(t.shape) == (num_blocks, kv_heads, block_size),
               f"{name} must be contiguous float32 [{num_blocks}, {kv_heads}, {block_size}] in mode 5")
    _check(block_table.dim() == 2 and block_table.dtype == torch.int32 and block_table.shape[0] == batch,
           f"block_table must be [{batch}, M] int32")
    if not isinstance(actual_seq_lengths_kv, (list, tuple)) or not all(isinstance(n, int) for n in actual_seq_lengths_kv):
        raise TypeError("npu_fused_infer_attention_score(): argument 'actual_seq_lengths_kv' must be tuple of ints")
    _check(len(actual_seq_lengths_kv) == batch, f"actual_seq_lengths_kv needs {batch} entries")
    capacity = block_table.shape[1] * block_size
    _check(all(0 < n <= capacity for n in actual_seq_lengths_kv), f"context lengths {actual_seq_lengths_kv} "
           f"outside the table's {capacity} slots")
    _check(bool(((block_table >= 0) & (block_table < num_blocks)).all()), "block_table outside the pool")
    # The operator's formula, in the reference's order of roundings (so a generation through the fake
    # can equal the CPU path token for token): codes and scales packed back into the pool's rows
    # (kernels/kv_quant.py), read by the reference decode attention.
    key_rows, value_rows = (
        torch.cat((codes.view(num_blocks, block_size, kv_heads, head_dim),
                   scales.transpose(1, 2).unsqueeze(-1).contiguous().view(torch.int8)), dim=-1)
        for codes, scales in ((key, key_antiquant_scale), (value, value_antiquant_scale))
    )
    lens = np.array(actual_seq_lengths_kv, dtype=np.int32)
    gather = build_decode_gather(block_table.numpy(), lens, block_size, query.device)
    out = reference.paged_decode_attention(query[:, 0], key_rows, value_rows, block_table, torch.from_numpy(lens),
                                           scale, gather)
    return out.unsqueeze(1), torch.empty(0, dtype=torch.float32)
