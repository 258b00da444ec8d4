"""Pure-torch reference kernels of multi-head latent attention (DeepSeek-V3, GLM-5) and of the DSA
indexer's top-k selection (DeepSeek-V3.2, GLM-5).

MLA caches one latent per token and layer: ``C = kv_lora_rank + qk_rope_head_dim`` values, the
normalised compressed key/value (R = kv_lora_rank) followed by the rotated shared key (dr). The
absorbed decode attends over that latent directly: every query head is a row of a one-KV-head
attention whose keys are the whole latent and whose values are its first R values.

The DSA indexer caches one key per token and layer (Di = index_head_dim values), scores every cached
position for each query token, ``sum_h w[t, h] * relu(scale * q[t, h] . k[p])``, and keeps the
best ``index_topk`` positions at or before the query's; attention then sees only those.

Shape letters as in ``kernels.reference``, plus C = latent width, R = kv_lora_rank, Hi = indexer
heads, K = index_topk. A selection is [T, K] int64 positions within each token's sequence, -1 where
the context has fewer than K positions.
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engines.attention_metadata import AttentionMetadata, DecodeGather


def write_latent(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's per-token cache rows in place: values [T, C] into cache [N, BS, C]
    (contiguous) at slot = block_id * BS + offset."""
    # view (not reshape) so a non-contiguous cache fails loudly instead of writing into a copy
    cache.view(-1, cache.shape[-1]).index_copy_(0, slot_mapping, values.to(cache.dtype))


def selection_mask(selected: torch.Tensor, length: int) -> torch.Tensor:
    """[n, K] selected positions (-1: none) -> [n, length] bool, True at the selected ones."""
    # -1 lands in an extra last column that is cut off
    columns = torch.where(selected < 0, length, selected)
    mask = torch.zeros(selected.shape[0], length + 1, dtype=torch.bool, device=selected.device)
    return mask.scatter_(1, columns, True)[:, :length]


def mla_decode_attention(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_lora_rank: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    gather: "DecodeGather",
    selected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Absorbed MLA decode: one new token per sequence attends over its cached latents.

    query: [S, H, C], each head's ``W_UK``-absorbed no-rope query (R) then its rotated query (dr);
    latent_cache: [N, BS, C]; block_tables: [S, B] int32 and seq_lens: [S] int32 (read through
    ``gather``, the step's plan, as ``kernels.reference.paged_decode_attention`` does); selected:
    [S, K] DSA selection or None (every position). Returns [S, H, R], the attention-weighted latents
    (the caller applies ``W_UV``).
    """
    num_seqs = query.shape[0]
    block_size, width = latent_cache.shape[1:]
    gathered_len = gather.block_ids.shape[0] // num_seqs * block_size
    # context: [S, Lc, C]: whole blocks, then cut to the longest context
    context = latent_cache.index_select(0, gather.block_ids).view(num_seqs, gathered_len, width)  # whole blocks
    context = context[:, : gather.context_len].unsqueeze(1)  # [S, 1, Lc, C]: one KV head
    mask = gather.mask  # [S, 1, 1, Lc] or None
    if selected is not None:
        chosen = selection_mask(selected, gather.context_len).view(num_seqs, 1, 1, -1)
        mask = chosen if mask is None else mask & chosen
    # q: [S, 1, H, C]: the H heads are H query rows of the single latent head
    out = F.scaled_dot_product_attention(
        query.unsqueeze(1), context, context[..., :kv_lora_rank], attn_mask=mask, scale=scale
    )
    return out.squeeze(1)  # [S, H, R]


def latent_context(
    cache: torch.Tensor, block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int]
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Per prefill sequence: its query rows [start, end) and its whole cached context, [seq_len, C]
    from cache [N, BS, C] (the new tokens already written)."""
    block_size, width = cache.shape[1:]
    tables = block_tables.long()
    for i, seq_len in enumerate(seq_lens):
        blocks = tables[i, : -(-seq_len // block_size)]
        context = cache.index_select(0, blocks).reshape(-1, width)[:seq_len]
        yield query_start_loc[i], query_start_loc[i + 1], context


def indexer_topk(
    query: torch.Tensor,
    weights: torch.Tensor,
    index_cache: torch.Tensor,
    metadata: "AttentionMetadata",
    topk: int,
    scale: float,
) -> torch.Tensor:
    """The DSA selection of every new token, as transformers' indexer computes it.

    query: [T, Hi, Di] (rotated); weights: [T, Hi] float32 (each head's weight, times Hi ** -0.5);
    index_cache: [N, BS, Di] (holding the new tokens' keys). Scores are float32: for token t and a
    cached position p at or before t's, ``sum_h weights[t, h] * relu(scale * query[t, h] . key[p])``;
    the K = ``topk`` best are kept (all of them when the context is shorter). Returns [T, K] int64.
    """
    num_decode = metadata.num_decode_seqs
    out = torch.full((query.shape[0], topk), -1, dtype=torch.int64, device=query.device)
    if num_decode:
        gather = metadata.decode_gather
        block_size, width = index_cache.shape[1:]
        gathered_len = gather.block_ids.shape[0] // num_decode * block_size
        keys = index_cache.index_select(0, gather.block_ids).view(num_decode, gathered_len, width)
        keys = keys[:, : gather.context_len]  # [S, Lc, Di]
        visible = None if gather.mask is None else gather.mask.view(num_decode, 1, -1)  # [S, 1, Lc]
        out[:num_decode] = _top_positions(query[:num_decode, None], weights[:num_decode, None], keys, visible,
                                          topk, scale).squeeze(1)
    offset = num_decode  # prefill tokens follow the decode tokens
    for start, end, keys in latent_context(index_cache, metadata.block_tables[num_decode:],
                                           metadata.prefill_query_start_loc, metadata.prefill_seq_lens):
        seq_len = keys.shape[0]
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=keys.device)[:, None]
        causal = torch.arange(seq_len, device=keys.device)[None, :] <= q_pos  # [q_len, L]
        rows = slice(offset + start, offset + end)
        out[rows] = _top_positions(query[rows][None], weights[rows][None], keys[None], causal[None], topk, scale)[0]
    return out


def _top_positions(
    query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor | None, topk: int,
    scale: float,
) -> torch.Tensor:
    """query [B, Q, Hi, Di], weights [B, Q, Hi], keys [B, L, Di], visible [B, Q | 1, L] bool or None
    -> [B, Q, K] the best visible positions, -1 past the visible count. transformers' order of
    operations: per-head float32 scores, relu, then the weighted sum over heads as one matmul."""
    # scores: [B, Q, Hi, L]
    scores = F.relu(torch.matmul(query.float(), keys.float().transpose(-1, -2).unsqueeze(1)) * scale)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [B, Q, L]
    if visible is not None:
        index_scores = index_scores.masked_fill(~visible, float("-inf"))
    k = min(topk, index_scores.shape[-1])
    values, positions = index_scores.topk(k, dim=-1)
    positions = positions.masked_fill(values == float("-inf"), -1)
    if k < topk:
        positions = F.pad(positions, (0, topk - k), value=-1)
    return positions


# function name -> function, merged into ``kernels.reference.OPS``
OPS = {fn.__name__: fn for fn in (write_latent, mla_decode_attention, indexer_topk)}
