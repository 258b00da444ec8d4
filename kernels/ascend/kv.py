"""Ascend kernels for a KV cache stored in another dtype than the model's (``--kv-cache-dtype``): int8
("C8") for a float16 / bfloat16 model, and float16 / bfloat16 for a model in another dtype (float32).
Same signatures as ``xinserve.kernels.references.dense``; the registry offers this module on "npu" only where the KV
dtype differs from the model's (``serves``), after ``xinserve.kernels.ascend.ops``, which reads a cache in the model's
dtype in place.

int8, as the torch_npu / CANN documentation of ``npu_fused_infer_attention_score`` (FIA) allows it:
- write: ``npu_dynamic_quant`` quantizes each token's head symmetrically (scale = absmax / 127, the
  pool's rule, kernels/kv_quant.py) and ``npu_scatter_nd_update_`` stores codes + scale as one row.
- decode (one query token): FIA's ``key_antiquant_mode`` / ``value_antiquant_mode`` 5, "per token and
  per head, scales managed as pages" — int8 blocks [blocks, BS, KVH * D] and float32 scales
  [blocks, KVH, BS] read through the same block table, i.e. exactly the pool's per-token-per-head scales,
  only beside the codes instead of in the row. The step's blocks are gathered into that form
  (kernels/kv_compact.py) and FIA dequantizes as it reads.
- prefill (several query tokens): FIA takes no antiquant scales with PageAttention there ("page
  attention不支持伪量化场景"), so the step's blocks are read back in the model's dtype into a compact pool
  and ``xinserve.kernels.ascend.ops``'s prefill attention runs over it.
fp8 is refused: Atlas A2 / A3 have no fp8 KV path (vllm-ascend's C8 is int8).

Half precision for another model dtype: the query is cast to the cache's dtype for ``xinserve.kernels.ascend.ops``'s
operators and the output cast back; keys and values are cast before the write.

Nothing here has run on an Ascend device: it follows the operator documentation and is checked against
the fake torch_npu (tests/fakes/torch_npu/kv_int8.py).
"""

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch_npu

from xinserve.kernels import kv_compact, kv_quant
from xinserve.kernels.ascend import ops as npu
from xinserve.kernels.ascend.mla import HALF_PRECISION
from xinserve.kernels.model_shapes import ModelShapes

if TYPE_CHECKING:
    from xinserve.kernels.attention_metadata import DecodeGather

# key_antiquant_mode / value_antiquant_mode: per token and per KV head, scales in pages beside the blocks
PER_TOKEN_HEAD_PAGED = 5
KV_OPS = ("write_kv", "prefill_attention", "decode_attention")


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key, value: [T, KVH, D] in the model's dtype; key_cache, value_cache: [N, BS, KVH, D (+ 4)] in the
    KV dtype; slot_mapping: [T] int64."""
    if not kv_quant.is_quantized(key_cache.dtype):
        npu.write_kv(key.to(key_cache.dtype), value.to(key_cache.dtype), key_cache, value_cache, slot_mapping)
        return
    if not slot_mapping.numel():  # the operators reject empty tensors
        return
    num_kv_heads, width = key_cache.shape[-2:]
    slots = slot_mapping.view(-1, 1)
    for new, cache in ((key, key_cache), (value, value_cache)):
        codes, scale = torch_npu.npu_dynamic_quant(new.contiguous())  # [T, KVH, D] int8, [T, KVH] float32
        # an all-zero head keeps scale 1, as kv_quant stores it (its codes are 0 either way)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        rows = torch.cat((codes, scale.unsqueeze(-1).view(torch.int8)), dim=-1)  # [T, KVH, D + 4]
        torch_npu.npu_scatter_nd_update_(cache.view(-1, num_kv_heads * width), slots, rows.view(len(rows), -1))


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                            scale: float) -> torch.Tensor:
    """query: [T, H, D]; block_tables: [P, B] int32; host lists query_start_loc [P + 1], seq_lens [P].
    Returns [T, H, D] in the query's dtype."""
    if not kv_quant.is_quantized(key_cache.dtype):
        out = npu.paged_prefill_attention(query.to(key_cache.dtype), key_cache, value_cache, block_tables,
                                          query_start_loc, seq_lens, scale)
        return out.to(query.dtype)
    block_size, head_dim = key_cache.shape[1], query.shape[2]
    width = max(-(-n // block_size) for n in seq_lens)
    block_ids, tables = kv_compact.step_blocks(block_tables, width)
    keys = kv_compact.read_back(key_cache, block_ids, head_dim, query.dtype)  # [P * W, BS, KVH, D]
    values = kv_compact.read_back(value_cache, block_ids, head_dim, query.dtype)
    return npu.paged_prefill_attention(query, keys, values, tables, query_start_loc, seq_lens, scale)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           gather: "DecodeGather") -> torch.Tensor:
    """query: [S, H, D]; block_tables: [S, B] int32; the context lengths are read from the host copy
    ``gather.host_seq_lens``, and its ``block_ids`` name the blocks to read. Returns [S, H, D]."""
    if not kv_quant.is_quantized(key_cache.dtype):
        out = npu.paged_decode_attention(query.to(key_cache.dtype), key_cache, value_cache, block_tables,
                                         seq_lens, scale, gather)
        return out.to(query.dtype)
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    key_codes, key_scales = kv_compact.codes_and_scales(key_cache, gather.block_ids, head_dim)
    value_codes, value_scales = kv_compact.codes_and_scales(value_cache, gather.block_ids, head_dim)
    num_blocks = key_codes.shape[0]
    out, _ = torch_npu.npu_fused_infer_attention_score(
        query.contiguous().unsqueeze(1),  # [S, 1, H, D]: BSND, one query token per sequence
        # PageAttention with BSND reads the blocks as [blocks, BS, KVH * D]
        key_codes.view(num_blocks, block_size, num_kv_heads * head_dim),
        value_codes.view(num_blocks, block_size, num_kv_heads * head_dim),
        key_antiquant_scale=key_scales,  # [blocks, KVH, BS] float32
        value_antiquant_scale=value_scales,
        key_antiquant_mode=PER_TOKEN_HEAD_PAGED,
        value_antiquant_mode=PER_TOKEN_HEAD_PAGED,
        block_table=kv_compact.compact_tables(num_seqs, num_blocks // num_seqs, query.device),
        actual_seq_lengths_kv=gather.host_seq_lens.tolist(),  # a host copy: no device sync
        input_layout="BSND",
        num_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        scale=scale,
        block_size=block_size,
    )
    return out.view(num_seqs, num_heads, head_dim)


# Both paths read host lengths at launch (FIA's actual_seq_lengths_kv; ``xinserve.kernels.ascend.ops``'s paged attention
# is re-issued per replay only when it is the chosen function itself): a captured graph would freeze them.
paged_decode_attention.graph_capturable = False

OPS = {fn.__name__: fn for fn in (write_kv, paged_prefill_attention, paged_decode_attention)}


def serves(op: str, shapes: ModelShapes, dtype: torch.dtype) -> bool:
    """A candidate only for the KV cache ops of a model whose KV dtype is not its own."""
    return op in KV_OPS and shapes.kv_cache_dtype not in (None, dtype)


def unsupported(op: str, shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    """Why the operators behind ``op`` reject this model's shapes, dtype or KV dtype; None when they take them."""
    kv = shapes.kv_cache_dtype
    if not kv_quant.is_quantized(kv):
        # kernels.npu's operators, run in the cache's dtype
        return npu.unsupported(op, replace(shapes, kv_cache_dtype=None), kv)
    if kv != torch.int8:
        return f"KV cache dtype {kv} unsupported (Ascend's int8 \"C8\" KV cache is the 8-bit kind here)"
    if dtype not in HALF_PRECISION:
        return f"{dtype} with an int8 KV cache unsupported (npu_dynamic_quant and FIA take float16 / bfloat16)"
    if op == "prefill_attention":  # over a compact pool in the model's dtype
        return npu.unsupported(op, replace(shapes, kv_cache_dtype=None), dtype)
    if op == "decode_attention":
        return _int8_decode_limits(shapes)
    return None


def _int8_decode_limits(shapes: ModelShapes) -> str | None:
    # FIA with one query token, int8 PageAttention: block size 32-aligned, D at most 512 (32-byte rows),
    # at most 256 query heads and 64 per KV head.
    bs, d = shapes.block_size, shapes.head_dim
    if shapes.sliding_window is not None:
        return "sliding window unsupported (not implemented for the Ascend attention operators here)"
    if bs % 32:
        return f"block_size {bs} unsupported with an int8 KV cache (a multiple of 32)"
    if d % 32 or d > 512:
        return f"head_dim {d} unsupported with an int8 KV cache (a multiple of 32 up to 512)"
    if shapes.num_heads > 256 or shapes.num_heads // shapes.num_kv_heads > 64:
        return (f"{shapes.num_heads} heads over {shapes.num_kv_heads} KV heads unsupported "
                "(at most 256 heads, 64 per KV head)")
    return None
