"""Prefill attention through SDPA's fused path: several prompts per call, GQA without repeated K/V.

The reference (``kernels/references/dense.py``) makes one 3-D SDPA call per sequence with each KV head
repeated for its query heads. Torch's CPU SDPA takes its fused, tiled (flash) kernel only for 4-D
inputs, so there every [q_len, L'] score matrix is materialised, soft-maxed and multiplied (the math
path): 38% of a c=32 round of 512-token prompts (``benchmarks/prefill.py --profile``: the ``profile`` of
benchmarks/results/prefill.json). Here:

- the G query heads that share a KV head are one 4-D batch row: queries [rows * KVH, G, q_len, D],
  keys and values [rows * KVH, 1, L', D] expanded over G (a stride-0 view, nothing is copied);
- whole prompts (no cached prefix, no window edge inside: plain causal) run together, end-padded to
  the longest of their group: a query at j sees keys <= j only, so the padding is never attended, and
  groups are cut where padding would cost more than ``PAD_SLACK`` of the attention work;
- a chunk after a cached prefix (or cut by a sliding window) runs alone, with its mask.

Any torch >= 2.4 (``enable_gqa`` came in 2.5; the expanded view needs nothing new). It is a registry
candidate like any other: probed against the reference on the model's shapes and timed.
"""

import torch
import torch.nn.functional as F

from xinserve.kernels import kv_quant
from xinserve.kernels.references.dense import prefill_context

# A group of whole prompts is padded to its longest; attention work grows with the square of a
# prompt's length, so a group stays while rows * longest^2 <= PAD_SLACK * sum(length^2).
PAD_SLACK = 1.25


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int], scale: float,
                            sliding_window: int | None = None) -> torch.Tensor:
    """The reference's signature and layouts (``xinserve.kernels.references.dense.paged_prefill_attention``):
    query [T, H, D] -> [T, H, D]."""
    head_dim = query.shape[2]
    out = torch.empty_like(query)
    whole: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []
    for start, end, k, v, mask in prefill_context(key_cache, value_cache, block_tables, query_start_loc, seq_lens,
                                                  sliding_window):
        # k, v: [L', KVH, D] in the query's dtype
        k, v = (kv_quant.dequantize(x, head_dim, query.dtype) for x in (k, v))
        if mask is None:
            whole.append((start, end, k, v))
        else:
            # mask [q_len, L'] broadcasts over the [KVH, G] batch dims
            o = _attend(query[start:end][None], k[None], v[None], mask, scale)
            out[start:end] = o[0]
    for group in _padding_groups(whole):
        _attend_whole(query, out, group, scale)
    return out


def _padding_groups(
    whole: list[tuple[int, int, torch.Tensor, torch.Tensor]],
) -> list[list[tuple[int, int, torch.Tensor, torch.Tensor]]]:
    """Whole prompts, longest first, cut into groups that ``PAD_SLACK`` allows to pad together."""
    groups: list[list[tuple[int, int, torch.Tensor, torch.Tensor]]] = []
    work = 0
    for item in sorted(whole, key=lambda w: w[0] - w[1]):  # longest first: a group's first is its longest
        length = item[1] - item[0]
        if groups:
            longest = groups[-1][0][1] - groups[-1][0][0]
            if (len(groups[-1]) + 1) * longest**2 <= PAD_SLACK * (work + length**2):
                groups[-1].append(item)
                work += length**2
                continue
        groups.append([item])
        work = length**2
    return groups


def _attend_whole(query: torch.Tensor, out: torch.Tensor, group: list[tuple[int, int, torch.Tensor, torch.Tensor]],
                  scale: float) -> None:
    """One causal call over a group of whole prompts, written into ``out`` at each prompt's rows."""
    if len(group) == 1:
        start, end, k, v = group[0]
        out[start:end] = _attend(query[start:end][None], k[None], v[None], None, scale)[0]
        return
    longest = group[0][1] - group[0][0]
    rows, (num_heads, head_dim), num_kv_heads = len(group), query.shape[1:], group[0][2].shape[1]
    # q: [rows, L, H, D]; k, v: [rows, L, KVH, D], zero past each prompt's end
    q = query.new_zeros(rows, longest, num_heads, head_dim)
    k = query.new_zeros(rows, longest, num_kv_heads, head_dim)
    v = torch.zeros_like(k)
    for i, (start, end, seq_k, seq_v) in enumerate(group):
        q[i, : end - start], k[i, : end - start], v[i, : end - start] = query[start:end], seq_k, seq_v
    o = _attend(q, k, v, None, scale)
    for i, (start, end, _, _) in enumerate(group):
        out[start:end] = o[i, : end - start]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """q: [R, Lq, H, D], k, v: [R, Lk, KVH, D] -> [R, Lq, H, D]; causal (top-left aligned) without
    ``mask``, else ``mask`` [Lq, Lk] bool (True: attended)."""
    rows, q_len, num_heads, head_dim = q.shape
    k_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    # q: [R, Lq, KVH, G, D] -> [R * KVH, G, Lq, D]; k, v: [R * KVH, 1 -> G, Lk, D] (a stride-0 view)
    q4 = q.view(rows, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(-1, group, q_len, head_dim)
    k4, v4 = (x.permute(0, 2, 1, 3).reshape(-1, 1, k_len, head_dim).expand(-1, group, -1, -1) for x in (k, v))
    o = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=mask is None, scale=scale)
    # o: [R * KVH, G, Lq, D] -> [R, Lq, KVH, G, D] -> [R, Lq, H, D]
    return o.view(rows, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4).reshape(rows, q_len, num_heads,
                                                                                           head_dim)


OPS = {"paged_prefill_attention": paged_prefill_attention}
