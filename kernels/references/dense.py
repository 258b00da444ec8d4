"""Pure-torch reference implementations of every kernel the models call.

Each device implementation (NPU, MUSA, Triton) keeps these exact signatures and is checked against
these functions at worker start (``kernels/registry.py``). They run anywhere torch runs, so they
are also the CPU path and the fallback of every other.

Shape letters: T = new tokens this step, S = sequences, H = query heads, KVH = key/value heads
(H = KVH * G for grouped-query attention), D = head dim, N = KV blocks, BS = block size,
B = max blocks per sequence; for mixture-of-experts E = experts, K = experts per token, Hd = hidden
size, I = one expert's intermediate size.

Sliding-window attention (Mistral, Qwen2's upper layers) is the ``sliding_window`` keyword of the two
attention functions: a query at position q sees the keys at positions q - sliding_window < p <= q,
as transformers defines the window. The model passes the keyword only on windowed layers, so an
implementation without windows need not accept it (its ``unsupported`` declines windowed models).
"""

import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from xinserve.kernels import kv_quant
from xinserve.kernels.attention_metadata import DecodeGather
from xinserve.kernels.references import lora as lora_reference
from xinserve.kernels.references import mla as mla_reference
from xinserve.kernels.references import quant as quant_reference
from xinserve.kernels.routing import MoeRouting


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's keys/values into the paged cache, in place, stored in the cache's dtype.

    key, value: [T, KVH, D]; key_cache, value_cache: [N, BS, KVH, D] (contiguous), or [N, BS, KVH, D + 4]
    for an 8-bit cache (codes + scale per head, kernels/kv_quant.py); slot_mapping: [T] int64,
    slot = block_id * BS + offset.
    """
    if torch.compiler.is_compiling():  # traced (engines/worker/graphs.py): the op that writes in place
        _write_kv_in_place(key, value, key_cache, value_cache, slot_mapping)
        return
    _scatter_kv(key, value, key_cache, value_cache, slot_mapping)


def _scatter_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                slot_mapping: torch.Tensor) -> None:
    # view (not reshape) so a non-contiguous cache fails loudly instead of writing into a copy
    num_kv_heads, width = key_cache.shape[-2:]
    for new, cache in ((key, key_cache), (value, value_cache)):
        rows = kv_quant.quantize(new, cache.dtype)  # [T, KVH, width]
        if kv_quant.is_quantized(cache.dtype):  # 8-bit rows copy as bytes (fp8 has no index_copy_)
            rows, cache = rows.view(torch.int8), cache.view(torch.int8)
        cache.view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, rows)


# torch.compile would turn the in-place scatter into a view of the cache into a copy of the whole cache
# and a write back, every layer of every step; as an opaque op that mutates its arguments it writes
# the new slots where they lie.
@torch.library.custom_op("xinserve::write_kv", mutates_args=("key_cache", "value_cache"))
def _write_kv_in_place(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    _scatter_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    gather: "DecodeGather",
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached context (the last
    ``sliding_window`` positions of it when set).

    query: [S, H, D] (the new token's key/value are already in the cache);
    key_cache, value_cache: [N, BS, KVH, D]; block_tables: [S, B] int32; seq_lens: [S] int32
    (context length including the new token). ``gather``: the step's gather plan, which this
    implementation reads instead of block_tables (kernels that read the cache in place take those
    and ignore the plan). Returns [S, H, D].

    Vectorised over sequences: every sequence gathers the same number of blocks and positions at or
    past its seq_len are masked, so there is no Python loop and no device-to-host sync.
    """
    if torch.compiler.is_compiling() and gather.host_seq_lens is not None:  # a compiled decode bucket
        return _live_decode_attention(query, key_cache, value_cache, seq_lens, scale, gather.block_ids,
                                      gather.context_len, gather.mask, gather.host_seq_lens, sliding_window)
    return _decode_attention(query, key_cache, value_cache, seq_lens, scale, gather, sliding_window)


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, seq_lens: torch.Tensor,
                      scale: float, gather: "DecodeGather", sliding_window: int | None) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    # k, v: [S, Lc, KVH, D] (read back in the query's dtype) -> [S, KVH, Lc, D]
    k = kv_quant.dequantize(gather.contexts(key_cache, num_seqs), head_dim, query.dtype).transpose(1, 2)
    v = kv_quant.dequantize(gather.contexts(value_cache, num_seqs), head_dim, query.dtype).transpose(1, 2)
    # GQA without repeating K/V: the G query heads sharing a KV head act as G query rows.
    # q: [S, KVH, G, D]
    q = query.view(num_seqs, num_kv_heads, group, head_dim)
    mask = gather.mask
    if sliding_window is not None:
        # the new token sits at seq_len - 1 and sees positions >= seq_len - window (per layer: the
        # plan is shared by windowed and full layers)
        positions = torch.arange(gather.context_len, device=seq_lens.device)
        inside = (positions[None, :] >= seq_lens[:, None] - sliding_window).view(num_seqs, 1, 1, -1)
        mask = inside if mask is None else mask & inside
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    # out: [S, KVH, G, D] -> [S, H, D]
    return out.reshape(num_seqs, num_heads, head_dim)


# A decode bucket's gather plan spans max_model_len (static shapes). Traced, the gather would copy every
# row's max_model_len positions in every layer, whatever the live context (a bucket of 32 took 284 ms
# against ~20 ms eager); as an opaque op it runs eagerly inside the compiled step over the live blocks.
@torch.library.custom_op("xinserve::live_decode_attention", mutates_args=())
def _live_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, block_ids: torch.Tensor, context_len: int,
                           mask: torch.Tensor | None, host_seq_lens: torch.Tensor,
                           sliding_window: int | None) -> torch.Tensor:
    gather = DecodeGather(block_ids, context_len, mask, host_seq_lens).live(query.shape[0], key_cache.shape[1])
    return _decode_attention(query, key_cache, value_cache, seq_lens, scale, gather, sliding_window)


@_live_decode_attention.register_fake
def _(query: torch.Tensor, *args) -> torch.Tensor:
    return torch.empty_like(query)  # [S, H, D]


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention for P prefill (or chunked-prefill) sequences, over the last
    ``sliding_window`` positions up to each query when set.

    query: [T, H, D], the new tokens of P sequences back to back; query_start_loc: P + 1 host
    offsets into query, from 0; seq_lens: P host context lengths including the new tokens, so the
    queries of sequence i sit at positions [seq_len - q_len, seq_len) after a cached prefix.
    key_cache, value_cache: [N, BS, KVH, D] (already holding the new tokens); block_tables: [P, B]
    int32. Returns [T, H, D].
    """
    group, head_dim = query.shape[1] // key_cache.shape[2], query.shape[2]
    out = torch.empty_like(query)
    for start, end, k, v, mask in prefill_context(key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                                  sliding_window):
        # k, v: [L', KVH, D] (read back in the query's dtype) -> [H, L', D] (each KV head repeated for its
        # G query heads)
        k = kv_quant.dequantize(k, head_dim, query.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
        v = kv_quant.dequantize(v, head_dim, query.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
        q = query[start:end].transpose(0, 1)  # [H, q_len, D]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)
        out[start:end] = o.transpose(0, 1)
    return out


def prefill_context(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: list[int],
    seq_lens: list[int],
    sliding_window: int | None = None,
) -> Iterator[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Per prefill sequence (layouts as in ``paged_prefill_attention``): its query rows [start, end),
    the keys and values any of its queries can see, k, v: [L', KVH, D] for positions [first,
    seq_len), and which of them each query sees, mask: [q_len, L'] bool, or None when the chunk is a
    whole prompt inside the window (plain causal: SDPA's ``is_causal``)."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    tables = block_tables.long()  # index_select takes int64 on every backend
    for i, seq_len in enumerate(seq_lens):
        start, end = query_start_loc[i], query_start_loc[i + 1]
        prefix = seq_len - (end - start)
        # keys [first, seq_len) are all that any query of the chunk can see; blocks before are skipped
        first = 0 if sliding_window is None else max(0, prefix - sliding_window + 1)
        first_block = first // block_size
        blocks = tables[i, first_block : -(-seq_len // block_size)]
        offset = first_block * block_size
        # whole blocks copy as contiguous runs: [n * BS, KVH, D], cut to [L', KVH, D]
        k = key_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[first - offset : seq_len - offset]
        v = value_cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[first - offset : seq_len - offset]
        mask = None
        if prefix or (sliding_window is not None and sliding_window < seq_len):
            # query j sits at absolute position prefix + j and sees keys [0, prefix + j], or only
            # those past prefix + j - window (SDPA's is_causal would align the triangle top left)
            q_pos = torch.arange(prefix, seq_len, device=key_cache.device)[:, None]
            k_pos = torch.arange(first, seq_len, device=key_cache.device)[None, :]
            mask = k_pos <= q_pos
            if sliding_window is not None:
                mask &= k_pos > q_pos - sliding_window
        yield start, end, k, v, mask

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


def select_experts(
    router_logits: torch.Tensor, routing: MoeRouting, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts and their weights (``MoeRouting`` says how).

    router_logits: [T, E] float32; correction_bias: [E] float32 when ``routing.correction_bias``.
    Returns (weights [T, K] float32, ids [T, K] int64). The order of operations is transformers'
    (Qwen3-MoE, Mixtral, GLM-4.5 routers), so float32 routing picks the same experts.
    """
    scores = router_logits.softmax(dim=-1) if routing.scoring == "softmax" else router_logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    if routing.num_groups > 1:
        num_tokens, num_experts = choice.shape
        # grouped: [T, groups, E / groups]; a group ranks by the sum of its two best experts
        grouped = choice.view(num_tokens, routing.num_groups, num_experts // routing.num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
        best = group_scores.topk(routing.topk_groups, dim=-1).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~kept[:, :, None], float("-inf")).view(num_tokens, num_experts)
    ids = choice.topk(routing.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling_factor, ids


# torch.compile cannot trace the per-expert loop: reading the counts on the host breaks the graph, and
# dynamo guards on every expert's count, so each new routing recompiled until the recompile limit left
# the decode eager. As an opaque op the compiled decode calls it as it is; the fake says the shape.
def opaque_moe_op(name: str) -> Callable[[Callable[..., torch.Tensor]], Callable[..., torch.Tensor]]:
    """Decorates a fused_moe implementation (its signature): called eagerly it runs as it is; traced by
    torch.compile (engines/worker/graphs.py) it is the opaque torch op ``xinserve::<name>``, whose fake tells
    the compiler the output's shape without running it."""

    def wrap(function: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        @torch.library.custom_op(f"xinserve::{name}", mutates_args=())
        def op(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> torch.Tensor:
            return function(hidden, w13, w2, topk_weights, topk_ids)

        op.register_fake(lambda hidden, *weights_and_routing: torch.empty_like(hidden))

        @functools.wraps(function)
        def dispatch(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
            if torch.compiler.is_compiling():
                return op(hidden, w13, w2, topk_weights, topk_ids)
            return function(hidden, w13, w2, topk_weights, topk_ids)

        return dispatch

    return wrap


@opaque_moe_op("fused_moe")
def fused_moe(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """The routed experts' SwiGLU MLPs, weighted and summed per token.

    hidden: [T, Hd]; w13: [E, 2I, Hd] (each expert's gate rows, then its up rows); w2: [E, Hd, I];
    topk_weights: [T, K] float32; topk_ids: [T, K] int32 or int64. Returns [T, Hd]:
    sum over k of weight_k * w2[e_k] @ (silu(gate_e_k x) * up_e_k x).

    The T * K (token, expert) rows are sorted by expert, so each expert's rows are one slice and run
    as one matmul pair; the weighted results are added back to their tokens (in float32). The
    per-expert row counts are read on the host once (to slice, and to skip experts without a row).
    """
    order, tokens, rows = sort_by_expert(hidden, topk_ids)
    counts = torch.bincount(topk_ids.reshape(-1), minlength=w13.shape[0]).tolist()
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            gate_up = F.linear(rows[start : start + count], w13[expert])  # [n, 2I]
            outputs.append(F.linear(silu_and_mul(gate_up), w2[expert]))  # [n, Hd]
            start += count
    return add_back_to_tokens(torch.cat(outputs), topk_weights, order, tokens, hidden)


def sort_by_expert(hidden: torch.Tensor, topk_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The T * K (token, expert) rows sorted by expert: (order [T * K], sorted row -> its (token, k)
    slot; tokens [T * K], the token of each sorted row; rows [T * K, Hd], their hidden states)."""
    order = topk_ids.reshape(-1).argsort(stable=True)
    tokens = order // topk_ids.shape[1]
    return order, tokens, hidden.index_select(0, tokens)


def add_back_to_tokens(down: torch.Tensor, topk_weights: torch.Tensor, order: torch.Tensor, tokens: torch.Tensor,
                       hidden: torch.Tensor) -> torch.Tensor:
    """down [T * K, Hd] (the experts' outputs, rows as ``sort_by_expert`` sorted them), weighted and
    summed per token in float32 -> [T, Hd] in hidden's dtype."""
    weighted = down.float() * topk_weights.reshape(-1).index_select(0, order)[:, None]
    out = torch.zeros(hidden.shape[0], hidden.shape[1], dtype=torch.float32, device=hidden.device)
    return out.index_add_(0, tokens, weighted).to(hidden.dtype)


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


# Eagerly it reads the per-expert row counts on the host, which a captured graph would freeze.
fused_moe.graph_capturable = False

# function name -> function, as every implementation module exposes (kernels/ops.py)
OPS = {
    fn.__name__: fn
    for fn in (write_kv, paged_prefill_attention, paged_decode_attention, rms_norm, rotary_cos_sin,
               rotary_embedding, silu_and_mul, select_experts, fused_moe, top_k_top_p)
} | {"linear": torch.nn.functional.linear} | mla_reference.OPS | quant_reference.OPS | lora_reference.OPS
