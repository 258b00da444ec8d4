"""FAKE torch_npu operators of multi-head latent attention and DSA (see the package docstring):
``npu_scatter_nd_update_``, the MLA form of ``npu_fused_infer_attention_score`` (query_rope /
key_rope), ``npu_sparse_flash_attention`` and ``npu_lightning_indexer``. Each checks the argument
conventions vllm-ascend's MLA / SFA backends use and computes the documented formula with
kernels/references/mla.py on CPU tensors."""

import numpy as np
import torch

from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.references import mla as mla_reference

HALF = (torch.float16, torch.bfloat16)
RIGHT_DOWN_CAUSAL = 3


def _check(ok: bool, op: str, detail: str) -> None:
    if not ok:
        raise RuntimeError(f"call {op} failed, error code 161002: {detail}")


def _int32(op: str, name: str, tensor: object) -> list[int]:
    _check(isinstance(tensor, torch.Tensor) and tensor.dtype == torch.int32 and tensor.dim() == 1, op,
           f"{name} must be a 1-D int32 tensor")
    return tensor.tolist()


def _paged_bsnd(op: str, name: str, cache: torch.Tensor, dtype: torch.dtype) -> None:
    """A PA_BSND cache [N, BS, 1, D]: rows of D contiguous values (the row stride may be wider)."""
    _check(cache.dim() == 4 and cache.shape[2] == 1, op, f"{name} must be [N, BS, 1, D], got {tuple(cache.shape)}")
    _check(cache.dtype == dtype, op, f"{name} dtype {cache.dtype} differs from the query's {dtype}")
    _check(cache.stride(-1) == 1, op, f"{name} rows must be contiguous")


def _latent(key: torch.Tensor, key_rope: torch.Tensor) -> torch.Tensor:
    return torch.cat((key.squeeze(2), key_rope.squeeze(2)), dim=-1)  # [N, BS, R + dr]


def npu_scatter_nd_update_(self: torch.Tensor, indices: torch.Tensor, updates: torch.Tensor) -> torch.Tensor:
    """self [M, C] (contiguous), indices [T, 1] int32 / int64 rows, updates [T, C]: in place."""
    op = "aclnnScatterNdUpdate"
    _check(self.dim() == 2 and self.is_contiguous(), op, "self must be a contiguous 2-D tensor")
    _check(indices.dim() == 2 and indices.shape[1] == 1 and indices.dtype in (torch.int32, torch.int64), op,
           "indices must be [T, 1] int32 / int64")
    _check(updates.shape == (indices.shape[0], self.shape[1]) and updates.dtype == self.dtype, op,
           f"updates must be [{indices.shape[0]}, {self.shape[1]}] {self.dtype}")
    _check(bool(((indices >= 0) & (indices < self.shape[0])).all()), op, "index out of range")
    self.index_copy_(0, indices.view(-1).long(), updates)
    return self


def mla_fused_infer_attention_score(query, key, value, query_rope, key_rope, *, num_heads, num_key_value_heads,
                                    input_layout, scale, sparse_mode, block_table, block_size, actual_seq_lengths,
                                    actual_seq_lengths_kv, atten_mask=None):
    """The MLA decode form: query [T, H, R] and query_rope [T, H, dr], one query token per batch
    (TND), key = value = the latent's nope part [N, BS, 1, R], key_rope [N, BS, 1, dr]."""
    op = "aclnnFusedInferAttentionScore"
    _check(input_layout == "TND" and sparse_mode == 0 and atten_mask is None, op,
           "the MLA decode form takes TND, sparse_mode 0, no mask")
    _check(query.dtype in HALF and query.dim() == 3 and query.is_contiguous(), op, "query must be [T, H, R] half")
    _check(query_rope.shape[:2] == query.shape[:2] and query_rope.dtype == query.dtype, op, "query_rope mismatch")
    _check(num_key_value_heads == 1 and query.shape[1] == num_heads, op, "MLA takes one KV head")
    _check(key is value, op, "MLA reads the latent as both key and value")
    _paged_bsnd(op, "key", key, query.dtype)
    _paged_bsnd(op, "key_rope", key_rope, query.dtype)
    _check(key.shape[1] == block_size and block_size % 16 == 0, op, f"block_size {block_size} unsupported")
    _check(list(actual_seq_lengths) == list(range(1, query.shape[0] + 1)), op, "one query token per batch")
    kv_lens = list(actual_seq_lengths_kv)
    _check(all(isinstance(n, int) and n > 0 for n in kv_lens) and len(kv_lens) == query.shape[0], op,
           "actual_seq_lengths_kv: one positive int per batch")
    _check(block_table.dtype == torch.int32 and block_table.shape[0] == query.shape[0], op, "block_table int32 [S, B]")
    gather = build_decode_gather(block_table.numpy(), np.array(kv_lens, dtype=np.int32), block_size, query.device)
    full_query = torch.cat((query, query_rope), dim=-1)
    out = mla_reference.mla_decode_attention(full_query, _latent(key, key_rope), query.shape[-1], block_table,
                                             torch.tensor(kv_lens, dtype=torch.int32), scale, gather)
    return out, torch.empty(0, dtype=torch.float32)


def npu_sparse_flash_attention(*, query, key, value, sparse_indices, scale_value, sparse_block_size, block_table,
                               actual_seq_lengths_query, actual_seq_lengths_kv, query_rope, key_rope, layout_query,
                               layout_kv, sparse_mode, attention_mode=2, return_softmax_lse=False):
    """MLA attention over the selected positions only: query [T, H, R] (TND), sparse_indices
    [T, 1, K] int32 positions within each sequence (-1: none), right-down causal (sparse_mode 3)."""
    op = "aclnnSparseFlashAttention"
    _check(layout_query == "TND" and layout_kv == "PA_BSND" and sparse_mode == RIGHT_DOWN_CAUSAL, op,
           "modelled: TND queries, PA_BSND caches, sparse_mode 3")
    _check(sparse_block_size == 1 and key is value, op, "sparse_block_size 1, the latent as key and value")
    _check(query.dtype in HALF and query.dim() == 3, op, "query must be [T, H, R] half")
    _paged_bsnd(op, "key", key, query.dtype)
    _paged_bsnd(op, "key_rope", key_rope, query.dtype)
    _check(sparse_indices.dtype == torch.int32 and sparse_indices.dim() == 3 and sparse_indices.shape[:2] ==
           (query.shape[0], 1), op, "sparse_indices must be [T, 1, K] int32")
    ends, kv_lens = _int32(op, "actual_seq_lengths_query", actual_seq_lengths_query), \
        _int32(op, "actual_seq_lengths_kv", actual_seq_lengths_kv)
    _check(ends[-1] == query.shape[0] and len(kv_lens) == len(ends), op, "lengths do not cover the query")
    latent = _latent(key, key_rope)
    block_size, num_rank = latent.shape[1], query.shape[-1]
    full_query = torch.cat((query, query_rope), dim=-1)
    out = query.new_empty(query.shape)
    starts = [0] + ends[:-1]
    for b, (start, end, kv_len) in enumerate(zip(starts, ends, kv_lens)):
        blocks = block_table[b, : -(-kv_len // block_size)].long()
        context = latent.index_select(0, blocks).reshape(-1, latent.shape[-1])[:kv_len]  # [L, C]
        for t in range(start, end):
            position = kv_len - (end - t)
            chosen = sparse_indices[t, 0].long()
            chosen = chosen[(chosen >= 0) & (chosen <= position)]
            keys = context.index_select(0, chosen)
            weights = torch.softmax((full_query[t].float() @ keys.float().T) * scale_value, dim=-1)
            out[t] = (weights @ keys[:, :num_rank].float()).to(query.dtype)
    return out, torch.empty(0), torch.empty(0)


def npu_lightning_indexer(query, key, weights, *, actual_seq_lengths_query, actual_seq_lengths_key, block_table,
                          layout_query="BSND", layout_key="BSND", sparse_count=2048, sparse_mode=3):
    """Per query token, the sparse_count best positions at or before its own (right-down causal) by
    sum_h weights[h] * relu(query[h] . key[p]); -1 past a shorter context. Returns (indices
    [T, 1, K] int32, their scores)."""
    op = "aclnnLightningIndexer"
    _check(layout_query == "TND" and layout_key == "PA_BSND" and sparse_mode == RIGHT_DOWN_CAUSAL, op,
           "modelled: TND queries, PA_BSND keys, sparse_mode 3")
    _check(query.dtype in HALF and query.dim() == 3 and query.is_contiguous(), op, "query must be [T, Hi, Di] half")
    _paged_bsnd(op, "key", key, query.dtype)
    _check(weights.shape == query.shape[:2] and weights.dtype == query.dtype, op, "weights must be [T, Hi], query dtype")
    _check(block_table.dtype == torch.int32, op, "block_table must be int32")
    ends, kv_lens = _int32(op, "actual_seq_lengths_query", actual_seq_lengths_query), \
        _int32(op, "actual_seq_lengths_key", actual_seq_lengths_key)
    _check(ends[-1] == query.shape[0] and len(kv_lens) == len(ends), op, "lengths do not cover the query")
    keys_all = key.squeeze(2)
    block_size = keys_all.shape[1]
    indices = torch.full((query.shape[0], 1, sparse_count), -1, dtype=torch.int32)
    values = torch.full((query.shape[0], 1, sparse_count), float("-inf"))
    starts = [0] + ends[:-1]
    for b, (start, end, kv_len) in enumerate(zip(starts, ends, kv_lens)):
        blocks = block_table[b, : -(-kv_len // block_size)].long()
        keys = keys_all.index_select(0, blocks).reshape(-1, keys_all.shape[-1])[:kv_len].float()
        for t in range(start, end):
            visible = kv_len - (end - t) + 1
            scores = (torch.relu(query[t].float() @ keys[:visible].T) * weights[t].float()[:, None]).sum(0)
            best = scores.topk(min(sparse_count, visible))
            indices[t, 0, : best.indices.numel()] = best.indices.to(torch.int32)
            values[t, 0, : best.values.numel()] = best.values
    return indices, values
