"""Ascend implementations of the multi-head latent attention and DSA ops (signatures of
``xinserve.kernels.references.mla``), through torch_npu; ``xinserve.kernels.ascend.ops`` exposes them in its ``OPS``.

The operator conventions follow how vllm-ascend's MLA / SFA backends call them:
- ``npu_scatter_nd_update_`` writes a step's latent (or indexer key) rows into the paged cache;
- ``npu_fused_infer_attention_score`` in its MLA form (``query_rope`` / ``key_rope``, one KV head,
  the latent's first R values as both key and value, layout TND with PageAttention) is the absorbed
  decode;
- ``npu_sparse_flash_attention`` (the same MLA form plus the selection, ``sparse_mode`` 3) is the
  absorbed decode of a DSA layer;
- ``npu_lightning_indexer`` (TND query, PA_BSND keys, right-down causal ``sparse_mode`` 3) scores
  and selects, returning positions within each sequence, -1 past a short context.

The key and rotary key are the two slices of each cached latent row [N, BS, 1, R] and [N, BS, 1,
dr] (views of one contiguous [N, BS, R + dr] cache: the operators read BSND blocks with the row
stride of the latent). Nothing here has run on an Ascend device: it is written against the
operator documentation and checked with the fake torch_npu (tests/fakes/torch_npu).
"""

from typing import TYPE_CHECKING

import torch
import torch_npu

from xinserve.kernels.model_shapes import ModelShapes

if TYPE_CHECKING:
    from xinserve.kernels.attention_metadata import AttentionMetadata, DecodeGather

HALF_PRECISION = (torch.float16, torch.bfloat16)
RIGHT_DOWN_CAUSAL = 3
NO_MASK = 0


def write_latent(values: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """values: [T, C] into cache [N, BS, C] (contiguous) at the slots [T] int64."""
    if not slot_mapping.numel():
        return
    width = cache.shape[-1]
    torch_npu.npu_scatter_nd_update_(cache.view(-1, width), slot_mapping.view(-1, 1),
                                     values.to(cache.dtype).contiguous())


def mla_decode_attention(query: torch.Tensor, latent_cache: torch.Tensor, kv_lora_rank: int,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         gather: "DecodeGather", selected: torch.Tensor | None = None) -> torch.Tensor:
    """query: [S, H, R + dr]; latent_cache: [N, BS, R + dr]; block_tables: [S, B] int32;
    selected: [S, K] or None. Returns [S, H, R]."""
    num_seqs, num_heads, _ = query.shape
    block_size = latent_cache.shape[1]
    q_nope, q_rope = query[..., :kv_lora_rank].contiguous(), query[..., kv_lora_rank:].contiguous()
    k_nope = latent_cache[..., :kv_lora_rank].unsqueeze(2)  # [N, BS, 1, R]
    k_rope = latent_cache[..., kv_lora_rank:].unsqueeze(2)  # [N, BS, 1, dr]
    if selected is None:
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q_nope, k_nope, k_nope, query_rope=q_rope, key_rope=k_rope, num_heads=num_heads,
            num_key_value_heads=1, input_layout="TND", scale=scale, sparse_mode=NO_MASK,
            block_table=block_tables, block_size=block_size,
            actual_seq_lengths=list(range(1, num_seqs + 1)),
            actual_seq_lengths_kv=gather.host_seq_lens.tolist(),  # a host copy: no device sync
        )
        return out
    query_ends = torch.arange(1, num_seqs + 1, dtype=torch.int32, device=query.device)
    out = torch_npu.npu_sparse_flash_attention(
        query=q_nope, key=k_nope, value=k_nope, sparse_indices=selected.to(torch.int32).unsqueeze(1),
        scale_value=scale, sparse_block_size=1, block_table=block_tables, actual_seq_lengths_query=query_ends,
        actual_seq_lengths_kv=seq_lens.to(torch.int32), query_rope=q_rope, key_rope=k_rope,
        layout_query="TND", layout_kv="PA_BSND", sparse_mode=RIGHT_DOWN_CAUSAL,
    )
    return out[0] if isinstance(out, tuple) else out


def indexer_topk(query: torch.Tensor, weights: torch.Tensor, index_cache: torch.Tensor, metadata: "AttentionMetadata",
                 topk: int, scale: float) -> torch.Tensor:
    """query: [T, Hi, Di]; weights: [T, Hi] float32; index_cache: [N, BS, Di]. Returns [T, K] int64."""
    num_decode = metadata.num_decode_seqs
    # cumulative query ends over the step's sequences: the decodes' single tokens, then the prefills
    ends = list(range(1, num_decode + 1)) + [num_decode + end for end in metadata.prefill_query_start_loc[1:]]
    # the operator sums w_h * relu(q_h . k) without a scale; relu(s x) = s relu(x) for s > 0
    indices, _ = torch_npu.npu_lightning_indexer(
        query=query, key=index_cache.unsqueeze(2), weights=(weights * scale).to(query.dtype),
        actual_seq_lengths_query=torch.tensor(ends, dtype=torch.int32, device=query.device),
        actual_seq_lengths_key=metadata.seq_lens.to(torch.int32), block_table=metadata.block_tables,
        layout_query="TND", layout_key="PA_BSND", sparse_count=topk, sparse_mode=RIGHT_DOWN_CAUSAL,
    )
    return indices.squeeze(1).long()  # [T, K], -1 past a context shorter than K


# Both build host arguments into each call (the lengths, the query ends) that a captured graph would
# replay as they were at capture, and no graph-task update is written for them.
mla_decode_attention.graph_capturable = False
indexer_topk.graph_capturable = False

OPS = {fn.__name__: fn for fn in (write_latent, mla_decode_attention, indexer_topk)}


def half_precision_only(shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    """The limit of most Ascend operators here (kernels/ascend/ops.py too): float16 / bfloat16 only."""
    if dtype not in HALF_PRECISION:
        return f"{str(dtype).removeprefix('torch.')} unsupported (float16 / bfloat16 only)"
    return None


def mla_decode_limits(shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    # FusedInferAttentionScore's MLA form: kv_lora_rank 512 and qk_rope_head_dim 64 (DeepSeek's
    # shapes), block size a multiple of 16 up to 512, at most 128 query heads.
    if (shapes.kv_lora_rank, shapes.qk_rope_head_dim) != (512, 64):
        return (f"kv_lora_rank {shapes.kv_lora_rank} / qk_rope_head_dim {shapes.qk_rope_head_dim} unsupported "
                "(512 / 64 only)")
    if shapes.block_size % 16 or shapes.block_size > 512:
        return f"block_size {shapes.block_size} unsupported (a multiple of 16 up to 512)"
    if shapes.num_heads > 128:
        return f"{shapes.num_heads} heads unsupported (at most 128)"
    return half_precision_only(shapes, dtype)


def indexer_limits(shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    # LightningIndexer: index_head_dim 128, at most 64 indexer heads, sparse_count up to 2048.
    if shapes.index_head_dim != 128 or shapes.index_n_heads > 64 or shapes.index_topk > 2048:
        return (f"index_head_dim {shapes.index_head_dim} / {shapes.index_n_heads} heads / topk {shapes.index_topk} "
                "unsupported (128 / at most 64 / at most 2048)")
    return half_precision_only(shapes, dtype)


LIMITS = {"write_latent": half_precision_only, "mla_decode_attention": mla_decode_limits,
          "indexer_topk": indexer_limits}
