"""Pure-torch reference implementations of every kernel the models call.

Each device implementation (NPU, MUSA, CUDA) keeps these exact signatures and is checked against
these functions at start-up. They run anywhere torch runs, so they are also the CPU path.

Shape letters: T = new tokens this step, S = sequences, H = query heads, KVH = key/value heads
(H = KVH * G for grouped-query attention), D = head dim, N = KV blocks, BS = block size,
B = max blocks per sequence.
"""

import torch
import torch.nn.functional as F


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
) -> torch.Tensor:
    """Attention of one new token per sequence over its whole cached context.

    query: [S, H, D] (the new token's key/value are already in the cache);
    key_cache, value_cache: [N, BS, KVH, D]; block_tables: [S, B] int32; seq_lens: [S] int32
    (context length including the new token). Returns [S, H, D].

    Vectorised over sequences: every sequence gathers B blocks and positions at or past its
    seq_len are masked, so there is no Python loop and no device-to-host sync.
    """
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = block_tables.shape[1] * block_size
    blocks = block_tables.long()
    # k, v: [S, B, BS, KVH, D] -> [S, KVH, L, D] with L = B * BS
    k = key_cache[blocks].view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    v = value_cache[blocks].view(num_seqs, max_len, num_kv_heads, head_dim).transpose(1, 2)
    # GQA without repeating K/V: the G query heads sharing a KV head act as G query rows.
    # q: [S, KVH, G, D]
    q = query.view(num_seqs, num_kv_heads, group, head_dim)
    # mask: [S, 1, 1, L], True where the position holds context
    positions = torch.arange(max_len, device=query.device)
    mask = (positions[None, :] < seq_lens[:, None]).view(num_seqs, 1, 1, max_len)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
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


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary position embedding on the first rotary_dim dims of each head (out of place).

    positions: [T] int64; query: [T, H, D]; key: [T, KVH, D]; cos_sin_cache: [max_positions,
    rotary_dim], cos of the rotary_dim / 2 frequencies then their sin. Dims past rotary_dim pass
    through unchanged (partial rotary). ``is_neox``: dim i pairs with i + rotary_dim / 2
    (Llama, Qwen); otherwise dims 2i and 2i + 1 pair up (GLM-4).
    """
    rotary_dim = cos_sin_cache.shape[-1]
    # cos, sin: [T, 1, rotary_dim / 2], broadcast over heads
    cos, sin = cos_sin_cache[positions].to(query.dtype).unsqueeze(1).chunk(2, dim=-1)
    return _rotate(query, cos, sin, rotary_dim, is_neox), _rotate(key, cos, sin, rotary_dim, is_neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, is_neox: bool) -> torch.Tensor:
    # x: [T, heads, D]; each pair (x1, x2) turns by the angle of its frequency
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((rotated, x_pass), dim=-1) if x_pass.shape[-1] else rotated


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: x [T, 2I] (gate then up) -> silu(gate) * up, [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
