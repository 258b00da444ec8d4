"""Pure-torch reference kernels of multi-head latent attention (DeepSeek-V3, GLM-5) and of the DSA
indexer's top-k selection (DeepSeek-V3.2, GLM-5).

MLA caches one latent per token and layer: ``C = kv_lora_rank + qk_rope_head_dim`` values, the
normalised compressed key/value (R = kv_lora_rank) followed by the rotated shared key (dr). The
absorbed decode attends over that latent directly: every query head is a row of a one-KV-head
attention whose keys are the whole latent and whose values are its first R values.

The DSA indexer caches one key per token and layer (Di = index_head_dim values), scores every cached
position for each query token, ``sum_h w[t, h] * relu(scale * q[t, h] . k[p])``, and keeps the
best ``index_topk`` positions at or before the query's; attention then sees only those.

Shape letters as in ``xinserve.kernels.references.dense``, plus C = latent width, R = kv_lora_rank, Hi = indexer
heads, K = index_topk. A selection is [T, K] int64 positions within each token's sequence, -1 where
the context has fewer than K positions.
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from xinserve.kernels.attention_metadata import DecodeGather

if TYPE_CHECKING:
    from xinserve.kernels.attention_metadata import AttentionMetadata


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
    ``gather``, the step's plan, as ``xinserve.kernels.references.dense.paged_decode_attention`` does); selected:
    [S, K] DSA selection or None (every position). Returns [S, H, R], the attention-weighted latents
    (the caller applies ``W_UV``).
    """
    if torch.compiler.is_compiling() and gather.host_seq_lens is not None:  # a compiled decode bucket
        return _live_mla_decode(query, latent_cache, kv_lora_rank, scale, gather.block_ids, gather.context_len,
                                gather.mask, gather.host_seq_lens, selected)
    return _mla_decode(query, latent_cache, kv_lora_rank, scale, gather, selected)


def _mla_decode(query: torch.Tensor, latent_cache: torch.Tensor, kv_lora_rank: int, scale: float,
                gather: "DecodeGather", selected: torch.Tensor | None) -> torch.Tensor:
    num_seqs = query.shape[0]
    # [S, 1, Lc, C]: one KV head, read back in the query's dtype (a half-precision cache is widened)
    context = gather.contexts(latent_cache, num_seqs).unsqueeze(1).to(query.dtype)
    mask = gather.mask  # [S, 1, 1, Lc] or None
    if selected is not None:
        chosen = selection_mask(selected, gather.context_len).view(num_seqs, 1, 1, -1)
        mask = chosen if mask is None else mask & chosen
    # q: [S, 1, H, C]: the H heads are H query rows of the single latent head
    out = F.scaled_dot_product_attention(
        query.unsqueeze(1), context, context[..., :kv_lora_rank], attn_mask=mask, scale=scale
    )
    return out.squeeze(1)  # [S, H, R]


# As kernels.reference's live decode attention: in a compiled decode bucket (whose plan spans
# max_model_len) an opaque op that gathers only the live latents.
@torch.library.custom_op("xinserve::live_mla_decode", mutates_args=())
def _live_mla_decode(query: torch.Tensor, latent_cache: torch.Tensor, kv_lora_rank: int, scale: float,
                     block_ids: torch.Tensor, context_len: int, mask: torch.Tensor | None, host_seq_lens: torch.Tensor,
                     selected: torch.Tensor | None) -> torch.Tensor:
    gather = DecodeGather(block_ids, context_len, mask, host_seq_lens).live(query.shape[0], latent_cache.shape[1])
    return _mla_decode(query, latent_cache, kv_lora_rank, scale, gather, selected)


@_live_mla_decode.register_fake
def _(query: torch.Tensor, latent_cache: torch.Tensor, kv_lora_rank: int, *args) -> torch.Tensor:
    return query.new_empty(*query.shape[:2], kv_lora_rank)  # [S, H, R]


def mla_prefill_attention(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_up_weight: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    selected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Up-projected MLA prefill (and chunked prefill): each sequence's cached latents up-projected to
    per-head keys and values, then causal attention, as ``xinserve.kernels.references.dense.paged_prefill_attention``.

    query: [T, H, dn + dr], the new tokens of P sequences back to back, each head's no-rope query
    then its rotated one; latent_cache: [N, BS, R + dr] (holding the new tokens); kv_up_weight:
    [H, dn + dv, R], ``kv_b_proj``'s weight per head (W_UK rows, then W_UV rows); block_tables:
    [P, B] int32; query_start_loc: P + 1 host offsets into query; seq_lens: P host context lengths
    including the new tokens; selected: [T, K] DSA selection or None (every position). Returns
    [T, H, dv].
    """
    num_heads, _, rank = kv_up_weight.shape
    nope_dim = query.shape[-1] - (latent_cache.shape[-1] - rank)
    up = kv_up_weight.reshape(-1, rank)  # [H * (dn + dv), R], kv_b_proj's own layout
    queries = query.transpose(0, 1)  # [H, T, dn + dr]
    out = query.new_empty(query.shape[0], num_heads, kv_up_weight.shape[1] - nope_dim)
    for start, end, context in latent_context(latent_cache, block_tables, query_start_loc, seq_lens):
        context = context.to(query.dtype)  # a half-precision cache is widened
        seq_len = context.shape[0]
        kv = F.linear(context[:, :rank], up).view(seq_len, num_heads, -1)
        k_nope, v = kv.split([nope_dim, kv.shape[-1] - nope_dim], dim=-1)  # [L, H, dn], [L, H, dv]
        k_rope = context[:, None, rank:].expand(-1, num_heads, -1)
        k = torch.cat((k_nope, k_rope), dim=-1).transpose(0, 1)  # [H, L, dn + dr]
        # query j sits at position seq_len - q_len + j and sees positions up to its own
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=context.device)[:, None]
        mask = torch.arange(seq_len, device=context.device)[None, :] <= q_pos  # [q_len, L]
        if selected is not None:
            mask &= selection_mask(selected[start:end], seq_len)
        o = F.scaled_dot_product_attention(queries[:, start:end], k, v.transpose(0, 1), attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


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

    Equal scores are common (a position scores exactly 0 when every head's relu is 0, often with few
    heads), and which of them torch.topk keeps depends on the length of the row it ranks. So each row
    is ranked as transformers' ``generate`` ranks it: a decode token over exactly its context; a
    prompt token over the whole prompt, the positions after it at -inf (transformers' prefill is one
    [prompt, prompt] causal block, whatever chunks the prompt is computed in here); a generated token
    recomputed after preemption over exactly its context (it was a decode there). A decode row of a
    verification step (engines/worker/decode_rows.py) is ranked over exactly its own context, as the decode
    that generated it was; a compiled decode bucket ranks its rows the same way (an opaque op).
    """
    num_decode = metadata.num_decode_seqs
    out = torch.full((query.shape[0], topk), -1, dtype=torch.int64, device=query.device)
    if num_decode:
        gather = metadata.decode_gather
        if torch.compiler.is_compiling() and gather.host_seq_lens is not None:  # a compiled decode bucket
            out[:num_decode] = _live_decode_topk(query[:num_decode], weights[:num_decode], index_cache,
                                                 gather.block_ids, gather.context_len, gather.mask,
                                                 gather.host_seq_lens, topk, scale)
        else:
            out[:num_decode] = _decode_topk(query[:num_decode], weights[:num_decode], index_cache, gather, topk,
                                            scale)
    offset = num_decode  # prefill tokens follow the decode tokens
    prompt_lens = metadata.prefill_prompt_lens or metadata.prefill_seq_lens
    for i, (start, end, keys) in enumerate(latent_context(index_cache, metadata.block_tables[num_decode:],
                                                         metadata.prefill_query_start_loc,
                                                         metadata.prefill_seq_lens)):
        seq_len = keys.shape[0]
        positions = torch.arange(seq_len - (end - start), seq_len)  # [q_len] on the host
        rows = slice(offset + start, offset + end)
        scores = _index_scores(query[rows][None], weights[rows][None], keys[None], scale)[0]  # [q_len, L]
        causal = torch.arange(seq_len, device=keys.device)[None, :] <= positions.to(keys.device)[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out[rows] = _rank_rows(scores, (positions + 1).clamp(min=prompt_lens[i]), topk)
    return out


def _decode_topk(query: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, gather: "DecodeGather",
                 topk: int, scale: float) -> torch.Tensor:
    """The decode rows' selection (query [S, Hi, Di], weights [S, Hi]) -> [S, K]: each row ranked
    over exactly its context (by the plan's host lengths)."""
    num_decode = query.shape[0]
    keys = gather.contexts(index_cache, num_decode)  # [S, Lc, Di]
    # scores: [S, Lc], -inf past each context
    scores = _index_scores(query[:, None], weights[:, None], keys, scale).squeeze(1)
    if gather.mask is None:
        return _top_positions(scores, topk)
    if gather.host_seq_lens is None:
        return _top_positions(scores.masked_fill(~gather.mask.view(num_decode, -1), float("-inf")), topk)
    return _rank_rows(scores, gather.host_seq_lens, topk)


@torch.library.custom_op("xinserve::live_decode_topk", mutates_args=())
def _live_decode_topk(query: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_ids: torch.Tensor,
                      context_len: int, mask: torch.Tensor | None, host_seq_lens: torch.Tensor, topk: int,
                      scale: float) -> torch.Tensor:
    gather = DecodeGather(block_ids, context_len, mask, host_seq_lens).live(query.shape[0], index_cache.shape[1])
    return _decode_topk(query, weights, index_cache, gather, topk, scale)


@_live_decode_topk.register_fake
def _(query: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, block_ids: torch.Tensor,
      context_len: int, mask: torch.Tensor | None, host_seq_lens: torch.Tensor, topk: int, scale: float) -> torch.Tensor:
    return query.new_empty(query.shape[0], topk, dtype=torch.int64)  # [S, K]


def _index_scores(query: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """query [B, Q, Hi, Di], weights [B, Q, Hi], keys [B, L, Di] -> [B, Q, L] float32, in transformers'
    order of operations: per-head float32 scores, relu, then the weighted sum over heads as one matmul."""
    # scores: [B, Q, Hi, L]
    scores = F.relu(torch.matmul(query.float(), keys.float().transpose(-1, -2).unsqueeze(1)) * scale)
    return torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)


def _rank_rows(scores: torch.Tensor, widths: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [R, L] (-inf where a row may not look), widths [R] host int -> [R, K]: row r ranked as a
    row of widths[r] positions (cut short, or padded with -inf), rows of one width in one topk."""
    length = scores.shape[1]
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int64, device=scores.device)
    for width in widths.unique().tolist():
        rows = (widths == width).nonzero().squeeze(1).to(scores.device)
        block = scores.index_select(0, rows)
        block = block[:, :width] if width <= length else F.pad(block, (0, width - length), value=float("-inf"))
        out[rows] = _top_positions(block, topk)
    return out


def _top_positions(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """scores [..., L] (-inf where not visible) -> [..., K] the best visible positions, -1 past the
    visible count."""
    k = min(topk, scores.shape[-1])
    values, positions = scores.topk(k, dim=-1)
    positions = positions.masked_fill(values == float("-inf"), -1)
    if k < topk:
        positions = F.pad(positions, (0, topk - k), value=-1)
    return positions


# Eagerly it ranks the decode rows by their host lengths, which a captured graph would freeze.
indexer_topk.graph_capturable = False
# Not yet shown to replay correctly: an MLA decode captured on the fake Ascend graph
# (tests/kernels/ascend/test_npu_graphs.py) gave other tokens than eager, cause not yet found; until it is,
# MLA models decode eagerly on accelerators (CPU compilation is unaffected).
mla_decode_attention.graph_capturable = False

# function name -> function, merged into ``xinserve.kernels.references.dense.OPS``
OPS = {fn.__name__: fn for fn in (write_latent, mla_decode_attention, mla_prefill_attention, indexer_topk)}
