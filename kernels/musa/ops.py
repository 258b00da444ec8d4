"""Attention over the paged KV cache on Moore Threads GPUs (torch_musa; MATE for decode).

Prefill: one ``scaled_dot_product_attention`` call per prefill sequence over its gathered blocks.
torch_musa routes SDPA to muDNN's flash kernel for float16/bfloat16 with head dims <= 128 (or 160)
on MP22 and later, GQA included (``enable_gqa``) and with a plain ``is_causal`` or a 2-D boolean
mask; anything else runs its math path. One call per sequence rather than one padded batch, which
would pay the longest sequence's length for every sequence and need a mask on all of them, or the
varlen flash op, which torch_musa exposes only as the private ``aten._flash_attention_forward``
with no documented causal alignment after a cached prefix. The price is a gather and one launch
per prefill sequence per layer, and the token budget keeps a step's prefill sequences few.

Decode: MATE's ``flash_attn_with_kvcache`` (github.com/MooreThreads/mate, ``mate/mha_interface.py``)
reads the cache in place through the block tables. MATE mirrors the FlashAttention-3 interface, so
the table is ``page_table`` (int32 [S, B]; FlashAttention-2 calls it ``block_table``), the lengths
``cache_seqlens`` (int32 [S]), and any page size works: unlike FlashAttention-2, which wants
multiples of 256, MATE's own tests cover pages of 1 to 111 tokens (64 takes its fastest load path).
MATE is built for MP31 (Pinghu) GPUs; where ``mate`` does not import, decode is declared
unsupported here and the registry falls through to Triton, then the reference.

An 8-bit KV cache (``--kv-cache-dtype fp8`` / ``int8``: codes and a float32 scale per token and head in
one row, kernels/kv_quant.py) is read back in the model's dtype: prefill widens each sequence's gathered
context; decode gathers the step's blocks into a compact half-precision pool (kernels/kv_compact.py)
that MATE reads through renumbered page tables. MATE's fp8 path (FlashAttention-3's ``k_descale`` /
``v_descale``) takes one scale per sequence and KV head, not one per token, and wants an fp8 query too,
so it cannot read these rows. The reference writes the cache (torch ops on the device).

Same signatures as ``xinserve.kernels.references.dense``. Importing this module needs torch_musa.
"""

import torch
import torch.nn.functional as F
import torch_musa  # noqa: F401  registers the musa device and routes SDPA to muDNN's flash kernel

from xinserve.kernels import kv_compact, kv_quant
from xinserve.kernels.attention_metadata import DecodeGather
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.references.dense import prefill_context

try:
    from mate import flash_attn_with_kvcache
except ImportError as exc:  # MATE missing, or built for another GPU architecture
    flash_attn_with_kvcache = None
    _MATE_MISSING = f"not installed (mate: {exc})"

FLASH_DTYPES = (torch.float16, torch.bfloat16)


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                            scale: float) -> torch.Tensor:
    """Causal attention for P prefill (or chunked-prefill) sequences; see the reference for the
    layouts. query: [T, H, D]; key_cache, value_cache: [N, BS, KVH, D (+ 4)]; block_tables: [P, B] int32.
    Returns [T, H, D]."""
    out = torch.empty_like(query)
    head_dim = query.shape[2]
    for start, end, k, v, mask in prefill_context(key_cache, value_cache, block_tables, query_start_loc, seq_lens):
        # an 8-bit context read back in the query's dtype (a half-precision one is returned as it is)
        k, v = (kv_quant.dequantize(t, head_dim, query.dtype) for t in (k, v))
        # k, v: [L, KVH, D] -> [KVH, L, D]; q: [H, q_len, D], the H / KVH query heads of a group share k, v
        q = query[start:end].transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                           is_causal=mask is None, scale=scale, enable_gqa=True)
        out[start:end] = o.transpose(0, 1)
    return out

def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           gather: DecodeGather) -> torch.Tensor:
    """One new token per sequence over its cached context, read in place by MATE (``gather``, the
    reference's plan, is not needed, except for an 8-bit cache: its ``block_ids`` name the blocks to read
    back). query: [S, H, D]; key_cache, value_cache: [N, BS, KVH, D (+ 4)]; block_tables: [S, B] int32;
    seq_lens: [S] int32. Returns [S, H, D]."""
    if kv_quant.is_quantized(key_cache.dtype):
        # [S * W, BS, KVH, D] in the query's dtype, W = the blocks gathered per sequence
        head_dim, num_seqs = query.shape[2], query.shape[0]
        key_cache = kv_compact.read_back(key_cache, gather.block_ids, head_dim, query.dtype)
        value_cache = kv_compact.read_back(value_cache, gather.block_ids, head_dim, query.dtype)
        block_tables = kv_compact.compact_tables(num_seqs, key_cache.shape[0] // num_seqs, query.device)
    # q: [S, 1, H, D], MATE's (batch, seqlen_q, heads, head_dim). A lone query sees its whole
    # context, so no causal mask is needed.
    out = flash_attn_with_kvcache(
        query.unsqueeze(1), key_cache, value_cache,
        cache_seqlens=seq_lens, page_table=block_tables, softmax_scale=scale, causal=False,
    )
    return out.view_as(query)


def unsupported(op: str, shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    """Why this module cannot serve ``op`` for the model, or None (the registry then probes it)."""
    kv = shapes.kv_cache_dtype
    if op in ("prefill_attention", "decode_attention") and kv not in (None, dtype) and not kv_quant.is_quantized(kv):
        return f"KV cache dtype {kv} unsupported (its kernels read an 8-bit cache or one in the model's dtype)"
    head_dim = shapes.head_dim
    if shapes.sliding_window is not None:  # both attention kernels here attend to the whole context
        return "sliding window unsupported (not implemented for MUSA attention here)"
    if op == "prefill_attention":
        if dtype not in FLASH_DTYPES:
            return f"{dtype} has no flash path (torch_musa's flash SDPA takes float16 and bfloat16)"
        if head_dim > 128 and head_dim != 160:
            return f"head_dim {head_dim} unsupported (torch_musa's flash SDPA: <= 128 or 160)"
    if op == "decode_attention":
        if flash_attn_with_kvcache is None:
            return _MATE_MISSING
        if dtype not in FLASH_DTYPES:
            return f"{dtype} unsupported (MATE's flash_attn_with_kvcache takes float16 and bfloat16)"
        # MATE rounds head dims up to 64, 128, 192, 256 and has no 192-wide kernel when K and V
        # share the head dim. Multiples of 8 (16-byte rows): FlashAttention-3, whose interface MATE
        # mirrors, requires them; MATE's own tests only use 128 and 256.
        if head_dim % 8 or head_dim > 256 or 128 < head_dim <= 192:
            return f"head_dim {head_dim} unsupported (MATE: a multiple of 8, <= 128 or 193..256)"
    return None


# function name -> function, as every implementation module exposes (kernels/ops.py)
OPS = {fn.__name__: fn for fn in (paged_prefill_attention, paged_decode_attention)}
