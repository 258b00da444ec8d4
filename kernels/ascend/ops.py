"""Ascend implementations through torch_npu, with the signatures of ``xinserve.kernels.references.dense``.

The argument conventions follow how vllm-ascend calls these operators (attention backend, device
adaptor, rotary, sampler, and its fused-MoE router, all-gather token dispatcher and unquantised expert
MLP); the limits in ``unsupported`` come from the torch_npu / CANN operator
documentation, so the registry skips a case the operator would reject instead of calling into it.
Importing this module raises ImportError where torch_npu is not installed.

Shape letters as in kernels/references/dense.py: T tokens, S sequences, H query heads, KVH key/value
heads, D head dim, N KV blocks, BS block size, B blocks per sequence, V vocabulary; E experts, K
experts per token, Hd hidden size, I one expert's intermediate size.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING

import torch
import torch_npu

from xinserve.kernels.ascend import lora as npu_lora
from xinserve.kernels.ascend import mla as npu_mla
from xinserve.kernels.ascend import quant as npu_quant
from xinserve.kernels.ascend.mla import half_precision_only
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.routing import MoeRouting

if TYPE_CHECKING:
    from xinserve.kernels.attention_metadata import DecodeGather

# sparse_mode 3 (right-down causal) reads a fixed 2048 x 2048 mask: 1 above the diagonal = masked.
# Aligned at the bottom right, it lets a chunk after a cached prefix see the prefix and itself causally.
CAUSAL_MASK_SIZE = 2048
RIGHT_DOWN_CAUSAL = 3
# MoeGatingTopK: at most 2048 experts, and a group's width rounded up to 32 times the groups as well
MAX_GATING_EXPERTS = 2048
GROUP_BY_TOP2_SUM = 1  # group_select_mode: a group ranks by the sum of its two best experts
# The task groups recorded while a graph is captured ((handle, call arguments) each), None otherwise.
_recording: list[tuple[object, dict]] | None = None


@contextmanager
def recording_graph_tasks() -> Iterator[Callable[[], None]]:
    """Wraps one graph capture (engines/worker/graphs.py): the paged decode attention calls made inside it
    are recorded as task groups. Yields what to call before each replay of that graph: it re-issues
    them, so they read the step's host lengths rather than those of the capture step."""
    global _recording
    tasks = _recording = []
    stream = torch.npu.Stream()

    def before_replay() -> None:
        update_graph_tasks(tasks, stream)

    try:
        yield before_replay
    finally:
        _recording = None


def update_graph_tasks(tasks: list[tuple[object, dict]], stream: object) -> None:
    """Re-issue each recorded paged attention into its task group of the captured graph, on
    ``stream``, which the replaying stream then waits for. The arguments are the static decode
    buffers themselves, so the call reads the lengths the step just copied into them."""
    with torch.npu.stream(stream):
        for handle, arguments in tasks:
            torch.npu.graph_task_update_begin(stream, handle)
            torch_npu._npu_paged_attention(**arguments)
            torch.npu.graph_task_update_end(stream)
    torch.npu.current_stream().wait_stream(stream)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key, value: [T, KVH, D]; key_cache, value_cache: [N, BS, KVH, D]; slot_mapping: [T] int64."""
    if not slot_mapping.numel():  # the operator rejects empty tensors
        return
    # The operator reads raw memory: value is a strided view of the fused qkv output, and the
    # slot indices must be int32.
    torch_npu._npu_reshape_and_cache(
        key=key.contiguous(),
        value=value.contiguous(),
        key_cache=key_cache,
        value_cache=value_cache,
        slot_indices=slot_mapping.to(torch.int32),
    )


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                            scale: float) -> torch.Tensor:
    """query: [T, H, D] (P sequences back to back); block_tables: [P, B] int32; host lists
    query_start_loc [P + 1] and seq_lens [P]. Returns [T, H, D]."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    out, _ = torch_npu.npu_fused_infer_attention_score(
        query,
        # PageAttention reads the cache as [N, BS, KVH * D] ("BnBsH") through the block table.
        key_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        value_cache.view(num_blocks, block_size, num_kv_heads * head_dim),
        atten_mask=_causal_mask(query.device),
        block_table=block_tables,
        input_layout="TND",
        block_size=block_size,
        # TND: query lengths are cumulative (the end of each sequence's tokens); with a block
        # table the key/value lengths are each sequence's own context length.
        actual_seq_lengths=query_start_loc[1:],
        actual_seq_lengths_kv=seq_lens,
        num_heads=query.shape[1],
        num_key_value_heads=num_kv_heads,
        scale=scale,
        sparse_mode=RIGHT_DOWN_CAUSAL,
    )
    return out


@cache
def _causal_mask(device: torch.device) -> torch.Tensor:
    # [2048, 2048] int8, built once per device
    return torch.ones(CAUSAL_MASK_SIZE, CAUSAL_MASK_SIZE, dtype=torch.int8, device=device).triu_(1)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           gather: "DecodeGather") -> torch.Tensor:
    """query: [S, H, D]; block_tables: [S, B] int32. The context lengths are read from the step's
    host copy (``gather.host_seq_lens``), as the operator wants them: a device copy would sync.

    The operator reads them when it is launched, so a captured graph would replay the lengths of its
    capture step: while a graph is captured (``recording_graph_tasks``) the call is made a task
    group and recorded, and each replay first re-issues it (``update_graph_tasks``)."""
    out = torch.empty_like(query)
    arguments = {
        "query": query, "key_cache": key_cache, "value_cache": value_cache, "num_kv_heads": key_cache.shape[2],
        "num_heads": query.shape[1], "scale_value": scale, "block_table": block_tables,
        "context_lens": gather.host_seq_lens, "out": out,
    }
    if _recording is None:
        torch_npu._npu_paged_attention(**arguments)
        return out
    stream = torch.npu.current_stream()
    torch.npu.graph_task_group_begin(stream)
    torch_npu._npu_paged_attention(**arguments)
    _recording.append((torch.npu.graph_task_group_end(stream), arguments))
    return out


# Each capture that calls it is wrapped in this (the registry collects it: KernelSelection.capture_hooks).
paged_decode_attention.graph_capture_hook = recording_graph_tasks


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [..., H]; weight: [H]. With ``residual``: ``(norm(x + residual), x + residual)``."""
    if residual is None:
        normed, _ = torch_npu.npu_rms_norm(x, weight, epsilon=eps)
        return normed
    normed, _, added = torch_npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)
    return normed, added


def rotary_cos_sin(
    positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [T], cache [max_positions, rotary_dim] in dtype): npu_mrope gathers the rows
    itself. The model's cache is already in its dtype, so this copies nothing per step."""
    return positions, cos_sin_cache.to(dtype)


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """query: [T, H, D]; key: [T, KVH, D]. The operator rotates the first rotary_dim dims (the
    cache's width) and passes the rest through."""
    positions, cos_sin_cache = cos_sin
    num_tokens, _, head_dim = query.shape
    # npu_mrope takes [T, heads * D]; mrope_section [0, 0, 0] is plain (one position per token) RoPE.
    rotated_query, rotated_key = torch_npu.npu_mrope(
        positions,
        query.reshape(num_tokens, -1),
        key.reshape(num_tokens, -1),
        cos_sin_cache,
        head_dim,
        mrope_section=[0, 0, 0],
        rotary_mode="half" if is_neox else "interleaved",
    )
    return rotated_query.view(query.shape), rotated_key.view(key.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] (gate then up) -> [T, I]."""
    return torch_npu.npu_swiglu(x, dim=-1)


def select_experts(
    router_logits: torch.Tensor, routing: MoeRouting, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] float32; correction_bias: [E] float32 or None. Returns (weights [T, K]
    float32, ids [T, K] int32)."""
    softmax = routing.scoring == "softmax"
    # The operator divides sigmoid weights by their sum (+ eps) itself and then scales them, but
    # leaves softmax weights as they are (renorm only 0 is supported): those are divided and scaled
    # here, as vllm-ascend does.
    weights, ids, _ = torch_npu.npu_moe_gating_top_k(
        router_logits,
        k=routing.top_k,
        bias=correction_bias,
        k_group=routing.topk_groups,
        group_count=routing.num_groups,
        group_select_mode=GROUP_BY_TOP2_SUM,
        renorm=0,
        norm_type=0 if softmax else 1,
        out_flag=False,
        routed_scaling_factor=1.0 if softmax else routing.scaling_factor,
        eps=1e-20,
    )
    if softmax:
        if routing.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * routing.scaling_factor
    return weights, ids


def fused_moe(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """hidden: [T, Hd]; w13: [E, 2I, Hd]; w2: [E, Hd, I]; topk_weights: [T, K] float32; topk_ids:
    [T, K] int32. Returns [T, Hd]."""
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    # expanded: [T * K, Hd], the rows sorted by expert; row_map: [T * K] int32, where each (token, k)
    # row went (a gather index); counts: [E], each expert's rows
    expanded, row_map, counts, _ = torch_npu.npu_moe_init_routing_v2(
        hidden,
        topk_ids,
        active_num=num_tokens * top_k,
        expert_num=num_experts,
        expert_tokens_num_type=1,  # counts, not their running sum
        expert_tokens_num_flag=True,
        active_expert_range=[0, num_experts],
        quant_mode=-1,  # not quantised
    )
    counts = counts.to(torch.int64)
    # One grouped matmul per projection over every expert; the weights are passed transposed
    # ([E, Hd, 2I] and [E, I, Hd] views), as vllm-ascend passes checkpoint-layout weights.
    grouped = {"split_item": 2, "group_type": 0, "group_list_type": 1, "group_list": counts}
    gate_up = torch_npu.npu_grouped_matmul([expanded], [w13.transpose(1, 2)], **grouped)[0]  # [T * K, 2I]
    down = torch_npu.npu_grouped_matmul([torch_npu.npu_swiglu(gate_up)], [w2.transpose(1, 2)], **grouped)[0]
    # each token's K rows back in place, weighted and summed: [T, Hd]
    return torch_npu.npu_moe_token_unpermute(
        permuted_tokens=down, sorted_indices=row_map, probs=topk_weights.to(down.dtype)
    )


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits: [N, V] float32; top_k: [N, 1] int64, 0 = keep all; top_p: [N, 1] float32."""
    # The operator takes k as [N] int32 with no "disabled" value: k = V keeps every token (vllm-ascend
    # passes V the same way); p as [N] in the logits' dtype.
    k = top_k.view(-1).masked_fill(top_k.view(-1) <= 0, logits.shape[1]).to(torch.int32)
    return torch_npu.npu_top_k_top_p(logits, p=top_p.view(-1).to(logits.dtype), k=k)


# function name -> function, as every implementation module exposes (kernels/ops.py)
OPS = {
    fn.__name__: fn
    for fn in (write_kv, paged_prefill_attention, paged_decode_attention, rms_norm, rotary_cos_sin,
               rotary_embedding, silu_and_mul, select_experts, fused_moe, top_k_top_p)
} | npu_mla.OPS | npu_quant.OPS | npu_lora.OPS  # the MLA / DSA ops, the quantized ones, multi-LoRA's


def unsupported(op: str, shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    """Why the operator behind ``op`` rejects this model's shapes or dtype; None when it takes them."""
    if op in ("write_kv", "prefill_attention", "decode_attention") and shapes.kv_cache_dtype not in (None, dtype):
        return f"KV cache dtype {shapes.kv_cache_dtype} unsupported (its kernels read a cache in the model's dtype)"
    check = _LIMITS.get(op)
    return None if check is None else check(shapes, dtype)


def _prefill_limits(shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    # npu_fused_infer_attention_score with Q_S > 1 and PageAttention: block size a multiple of 128
    # in [128, 512]; D 16-byte aligned and at most 512 (vllm-ascend moves D = 512 off this path);
    # at most 256 query heads and 64 query heads per KV head.
    bs, d = shapes.block_size, shapes.head_dim
    if shapes.sliding_window is not None:
        return _NO_WINDOW
    if bs % 128 or not 128 <= bs <= 512:
        return f"block_size {bs} unsupported (a multiple of 128 up to 512)"
    if d % 8 or d >= 512:
        return f"head_dim {d} unsupported (a multiple of 8 below 512)"
    if shapes.num_heads > 256 or shapes.num_heads // shapes.num_kv_heads > 64:
        return (f"{shapes.num_heads} heads over {shapes.num_kv_heads} KV heads unsupported "
                "(at most 256 heads, 64 per KV head)")
    return half_precision_only(shapes, dtype)


def _decode_limits(shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    # ATB PagedAttention: block size a multiple of 16, head size in (0, 256] and head size * block
    # size at most 128 * 128.
    bs, d = shapes.block_size, shapes.head_dim
    if shapes.sliding_window is not None:
        return _NO_WINDOW
    if bs % 16:
        return f"block_size {bs} unsupported (a multiple of 16)"
    if d > 256 or d * bs > 128 * 128:
        return f"head_dim {d} unsupported at block_size {bs} (at most 256, and head_dim * block_size 16384)"
    return half_precision_only(shapes, dtype)


def _rotary_limits(shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    # npu_mrope: head size and rotary dim multiples of 32 in half precision, of 16 in float32.
    multiple = 16 if dtype == torch.float32 else 32
    if shapes.head_dim % multiple or shapes.rotary_dim % multiple:
        dims = f"head_dim {shapes.head_dim} / rotary_dim {shapes.rotary_dim}"
        return f"{dims} unsupported (multiples of {multiple})"
    return None


def _fused_moe_limits(shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    # MoeGatingTopK (aclnn documentation): at most 2048 experts in equal groups of more than one
    # expert (group_select_mode 1), align_32(E / groups) * groups <= 2048, 1 <= k_group <= groups,
    # k <= E / groups * k_group, and only renorm 0: sigmoid weights are always divided by their sum.
    routing, experts = shapes.moe_routing, shapes.num_experts
    groups = routing.num_groups
    if experts > MAX_GATING_EXPERTS or experts % groups or experts // groups < 2:
        return f"{experts} experts in {groups} groups unsupported (MoeGatingTopK: <= 2048, equal groups of 2+)"
    if -(-(experts // groups) // 32) * 32 * groups > MAX_GATING_EXPERTS:
        return f"{groups} groups of {experts // groups} experts unsupported (32-aligned groups <= 2048)"
    if not 1 <= routing.topk_groups <= groups or routing.top_k > experts // groups * routing.topk_groups:
        return f"top {routing.top_k} of {routing.topk_groups} / {groups} groups unsupported"
    if routing.scoring == "sigmoid" and not routing.renormalize:
        return "sigmoid scores without renormalisation unsupported (MoeGatingTopK always renormalises them)"
    return None


# the message of the attention kernels for a model with a sliding window (they take no window here)
_NO_WINDOW = "sliding window unsupported (not implemented for the Ascend attention operators here)"

_LIMITS = {
    "write_kv": half_precision_only,  # ReshapeAndCache: float16 / bfloat16 / int8 caches
    "prefill_attention": _prefill_limits,
    "decode_attention": _decode_limits,
    "rotary": _rotary_limits,
    "fused_moe": _fused_moe_limits,
    **npu_mla.LIMITS,
    **npu_quant.LIMITS,
    **npu_lora.LIMITS,
}
