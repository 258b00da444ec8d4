"""Pure-torch reference implementations of every kernel the models call.

Each device implementation (NPU, MUSA, Triton) keeps these exact signatures and is checked against
these functions at worker start (``kernels/registry.py``). They run anywhere torch runs, so they
are also the CPU path and the fallback of every other.

Shape letters: T = new tokens this step, S = sequences, H = query heads, KVH = key/value heads
(H = KVH * G for grouped-query attention), D = head dim, N = KV blocks, BS = block size,
B = max blocks per sequence.
"""

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from engines.attention_metadata import DecodeGather


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys/values into the paged cache, in place.

    key, value: [T, KVH, D]; key_cache, value_cache: [N, BS, KVH, D] (contiguous);
    slot_mapping: [T] int64, slot = block_id * BS + offset.
    """
    # view (not reshape) so a non-contiguous cache fails loudly instead of writing into a copy
    num_kv_heads, head_dim = key_cache.shape[-2:]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    gather: "DecodeGather",
) -> torch.Tensor:
    """Attention of one new token per sequence over its whole cached context.

    query: [S, H, D] (the new token's key/value are already in the cache);
    key_cache, value_cache: [N, BS, KVH, D]; block_tables: [S, B] int32; seq_lens: [S] int32
    (context length including the new token). ``gather``: the step's gather plan, which this
    implementation reads instead of block_tables and seq_lens (kernels that read the cache in
    place take those and ignore the plan). Returns [S, H, D].

    Vectorised over sequences: every sequence gathers the same number of blocks and positions at or
    past its seq_len are masked, so there is no Python loop and no device-to-host sync.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    group = num_heads // num_kv_heads
    gathered_len = gather.block_ids.shape[0] // num_seqs * block_size
    # k, v: [S, Bg * BS, KVH, D] -> [S, KVH, Lc, D]. index_select over whole blocks (rows of
    # BS * KVH * D values) copies contiguous runs: several times faster than advanced indexing.
    k = key_cache.view(num_blocks, -1).index_select(0, gather.block_ids)
    v = value_cache.view(num_blocks, -1).index_select(0, gather.block_ids)
    k = k.view(num_seqs, gathered_len, num_kv_heads, head_dim)[:, : gather.context_len].transpose(1, 2)
    v = v.view(num_seqs, gathered_len, num_kv_heads, head_dim)[:, : gather.context_len].transpose(1, 2)
    # GQA without repeating K/V: the G query heads sharing a KV head act as G query rows.
    # q: [S, KVH, G, D]
    q = query.view(num_seqs, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=gather.mask, scale=scale)
    # out: [S, KVH, G, D] -> [S, H, D]
    return out.reshape(num_seqs, num_heads, head_dim)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:
    """Causal attention for P prefill (or chunked-prefill) sequences.

    query: [T, H, D], the new tokens of P sequences back to back; query_start_loc: P + 1 host
    offsets into query, from 0; seq_lens: P host context lengths including the new tokens, so the
    queries of sequence i sit at positions [seq_len - q_len, seq_len) after a cached prefix.
    key_cache, value_cache: [N, BS, KVH, D] (already holding the new tokens); block_tables: [P, B]
    int32. Returns [T, H, D].
    """
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        q_len = end - start
        num_blocks = -(-seq_len // block_size)
        blocks = block_tables[i, :num_blocks].long()
        # k, v: [L, KVH, D] -> [H, L, D] (each KV head repeated for its G query heads)
        k = key_cache[blocks].view(-1, num_kv_heads, head_dim)[:seq_len]
        v = value_cache[blocks].view(-1, num_kv_heads, head_dim)[:seq_len]
        k = k.transpose(0, 1).repeat_interleave(group, dim=0)
        v = v.transpose(0, 1).repeat_interleave(group, dim=0)
        q = query[start:end].transpose(0, 1)  # [H, q_len, D]
        if q_len == seq_len:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        else:
            # query j sits at absolute position prefix + j and sees keys [0, prefix + j]
            prefix = seq_len - q_len
            q_pos = torch.arange(prefix, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, L]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of x: [..., H], weight: [H].

    With ``residual`` (same shape as x) the residual add is fused in: returns
    ``(norm(x + residual), x + residual)``. The statistics are taken in float32 and the result is
    cast back to x.dtype before the weight multiply (the order Hugging Face models use).
    """
    if residual is not None:
        x = x + residual
        residual = x
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    normed = weight * normed.to(x.dtype)
    return normed if residual is None else (normed, residual)


def rotary_cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool, dtype: torch.dtype
) -> torch.Tensor:
    """The rotation of each token, laid out for ``rotary_embedding``: [2, T, 1, rotary_dim] in dtype.

    Row 0 holds each pair's cos twice, row 1 its sin with the sign of the pair's first element
    flipped, both in the pairing order of the style, so a rotation is ``x * cos + swap(x) * sin``
    where swap exchanges the two elements of every pair. It depends only on the positions: the
    model builds it once per step for all layers.
    """
    # cos, sin: [T, rotary_dim / 2]
    cos, sin = cos_sin_cache.index_select(0, positions).to(dtype).chunk(2, dim=-1)
    if is_neox:  # dim i pairs with i + rotary_dim / 2
        table = torch.stack((torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)))
    else:  # dims 2i and 2i + 1 pair up
        table = torch.stack((torch.stack((cos, cos), dim=-1), torch.stack((-sin, sin), dim=-1))).flatten(-2)
    return table.unsqueeze(2)


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding on the first rotary_dim dims of each head (out of place).

    query: [T, H, D]; key: [T, KVH, D]; cos_sin: the step's ``rotary_cos_sin`` ([2, T, 1,
    rotary_dim], built once for all layers). Dims past rotary_dim pass through unchanged (partial
    rotary). ``is_neox``: dim i pairs with i + rotary_dim / 2 (Llama, Qwen); otherwise dims 2i and
    2i + 1 pair up (GLM-4).
    """
    cos, sin = cos_sin  # each [T, 1, rotary_dim], broadcast over heads
    return _rotate(query, cos, sin, is_neox), _rotate(key, cos, sin, is_neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, heads, D]; each pair (x1, x2) turns by its angle: (x1 cos - x2 sin, x2 cos + x1 sin)
    rotary_dim = cos.shape[-1]
    x_rot = x[..., :rotary_dim] if rotary_dim < x.shape[-1] else x
    half = rotary_dim // 2
    # swapped: every pair's two elements exchanged (the halves for neox, neighbours otherwise)
    pairs = x_rot.unflatten(-1, (2, half) if is_neox else (half, 2))
    swapped = pairs.flip(-2 if is_neox else -1).flatten(-2)
    rotated = x_rot * cos + swapped * sin  # HF's order of roundings (addcmul would differ in bf16)
    return rotated if x_rot is x else torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: x [T, 2I] (gate then up) -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-k (``top_k`` [N, 1] int64, 0 = keep all), then top-p: keep the smallest set of most likely tokens whose
    probability (renormalised after top-k) reaches ``top_p`` ([N, 1] float32, 1 = keep all)."""
    vocab_size = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1)  # ascending: [N, V]
    # The k-th largest value sits at index V - k; k = 0 (disabled) reads index V - V = 0: keep all.
    kth = (vocab_size - top_k.clamp(min=0)).where(top_k > 0, 0)
    sorted_logits = sorted_logits.masked_fill(sorted_logits < sorted_logits.gather(1, kth), float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [N, V], rising to 1
    # The low tail whose total mass is at most 1 - p goes; the most likely token always stays.
    drop = cumulative <= 1 - top_p
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


# function name -> function, as every implementation module exposes (kernels/ops.py)
OPS = {
    fn.__name__: fn
    for fn in (write_kv, paged_prefill_attention, paged_decode_attention, rms_norm, rotary_cos_sin,
               rotary_embedding, silu_and_mul, top_k_top_p)
}
