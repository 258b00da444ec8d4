"""FAKE torch_npu, for tests only: importable as ``torch_npu`` when tests/fakes is put on sys.path.

It implements exactly the torch_npu functions that kernels/ascend/ops.py calls, with their documented
signatures, on CPU tensors. Each function first checks what the real operator checks (from the
torch_npu / CANN operator documentation and from how vllm-ascend calls it) and raises as the real
one would (RuntimeError naming the aclnn / ATB operator; TypeError where the Python binding itself
refuses an argument): layouts and shapes, dtypes (half precision for the attention operators, int32
slot indices, block tables and lengths, int lists for the TND lengths), contiguity, the block sizes
the paged kernels accept, and the TND / PageAttention length conventions.

Then it reads its arguments the way the operator does (caches through block tables, cumulative
query ends, per-sequence context lengths, the right-down causal mask, the two rotary pairings) and
computes the operator's documented formula with the pure-torch reference (kernels/references/dense.py), in
the reference's order of roundings, so a whole generation through the fake can be compared with the
CPU path token for token. Real kernels round differently (within the registry's tolerance).

What a fake cannot check: device placement (every tensor is on the CPU, so the host
``context_lens`` of the paged attention looks like any other), nor the real kernels' numerics,
speed or memory.
"""

import torch
import torch.nn.functional as F

from xinserve.kernels.attention_metadata import build_decode_gather
from xinserve.kernels.references import dense as reference
from xinserve.kernels.routing import MoeRouting

from . import npu  # graphs and streams; the real torch_npu registers its npu module as torch.npu too
from .kv_int8 import antiquant_paged_decode
from .lora import npu_batch_gather_matmul, npu_batch_gather_matmul_  # noqa: F401  AddLora, multi-LoRA's
from .mla import (  # noqa: F401  the MLA / DSA operators, part of this fake module's API
    mla_fused_infer_attention_score,
    npu_lightning_indexer,
    npu_scatter_nd_update_,
    npu_sparse_flash_attention,
)
from .moe_distribute import (  # noqa: F401  expert parallel's fused exchange, part of this fake module's API
    npu_moe_distribute_combine,
    npu_moe_distribute_dispatch,
)
from .quant import (  # noqa: F401  the quantisation operators, part of this fake module's API
    grouped_matmul_int8,
    npu_convert_weight_to_int4pack,
    npu_dynamic_quant,
    npu_quant_matmul,
    npu_quantize,
    npu_trans_quant_param,
    npu_weight_quant_batchmatmul,
)

torch.npu = npu

MASK_SIZE = 2048
# What sparse_mode 3 must be given: 1 (masked) strictly above the diagonal.
UPPER_TRIANGLE = torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu_(1)
MAX_INT32 = 2147483647
HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def _check(ok: bool, op: str, detail: str) -> None:
    # 161002 is ACLNN_ERR_PARAM_INVALID, the code CANN reports for a rejected argument.
    if not ok:
        raise RuntimeError(f"call {op} failed, error code 161002: {detail}")


def _dense(op: str, name: str, tensor: torch.Tensor, dims: int, dtypes: tuple[torch.dtype, ...]) -> None:
    _check(tensor.dim() == dims, op, f"{name} must be {dims}-D, got shape {tuple(tensor.shape)}")
    _check(tensor.dtype in dtypes, op, f"{name} dtype {tensor.dtype} unsupported")
    _check(tensor.is_contiguous(), op, f"{name} must be contiguous")


def _int_list(name: str, value: object) -> list[int]:
    """A SymInt[] argument: the binding takes a list of Python ints, never a tensor."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, int) for v in value):
        raise TypeError(f"npu_fused_infer_attention_score(): argument '{name}' must be tuple of ints, "
                        f"not {type(value).__name__}")
    return list(value)


# ---- KV cache write (ATB ReshapeAndCache) ----

def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices) -> None:
    """Scatter key/value [T, KVH, D] into caches [N, BS, KVH, D] (ND) at int32 slot indices [T]."""
    op = "atb ReshapeAndCacheOperation"
    for name, t in (("key", key), ("value", value)):
        _dense(op, name, t, 3, HALF + (torch.int8,))
    _check(value.shape == key.shape and key.shape[0] > 0, op, "key and value must be non-empty, same shape")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _dense(op, name, t, 4, (key.dtype,))
        _check(t.shape[2:] == key.shape[1:], op,
               f"{name} {tuple(t.shape)} is not [N, BS, KVH, D] for key {tuple(key.shape)}")
    _dense(op, "slot_indices", slot_indices, 1, (torch.int32,))
    _check(slot_indices.shape[0] == key.shape[0], op, "one slot per token expected")
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    _check(bool(((slot_indices >= 0) & (slot_indices < num_slots)).all()), op, "slot index out of range")
    reference.write_kv(key, value, key_cache, value_cache, slot_indices.long())


# ---- decode attention (ATB PagedAttention) ----

def _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value, block_table,
                         context_lens, out) -> None:
    """One query token per sequence over its paged context; writes out [S, H, D] in place."""
    op = "atb PagedAttentionOperation"
    _dense(op, "query", query, 3, HALF)
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        _dense(op, name, t, 4, (query.dtype,))
    num_seqs, heads, head_dim = query.shape
    block_size, kv_heads, cache_dim = key_cache.shape[1:]
    _check(heads == num_heads and kv_heads == num_kv_heads and cache_dim == head_dim, op,
           f"query {tuple(query.shape)} and cache {tuple(key_cache.shape)} do not match num_heads "
           f"{num_heads}, num_kv_heads {num_kv_heads} in the [N, BS, KVH, D] layout")
    _check(num_kv_heads > 0 and num_heads % num_kv_heads == 0, op, "num_heads must divide by num_kv_heads")
    _check(block_size % 16 == 0, op, f"block_size {block_size} must be a multiple of 16")
    _check(0 < head_dim <= 256 and head_dim * block_size <= 128 * 128, op,
           f"head_size {head_dim} with block_size {block_size} exceeds head_size * block_size <= 128 * 128")
    _dense(op, "block_table", block_table, 2, (torch.int32,))
    _dense(op, "context_lens", context_lens, 1, (torch.int32,))
    _check(block_table.shape[0] == num_seqs == context_lens.shape[0], op,
           "block_table and context_lens need one row per query")
    _check(out.shape == query.shape and out.dtype == query.dtype, op, "out must match query")
    capacity = block_table.shape[1] * block_size
    _check(bool(((context_lens > 0) & (context_lens <= capacity)).all()), op, "context length out of range")
    gather = build_decode_gather(block_table.numpy(), context_lens.numpy(), block_size, query.device)
    out.copy_(reference.paged_decode_attention(query, key_cache, value_cache, block_table, context_lens,
                                               scale_value, gather))


# ---- prefill / mixed attention (aclnnFusedInferAttentionScore) ----

def npu_fused_infer_attention_score(
    query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
    actual_seq_lengths_kv=None, block_table=None, num_heads=1, scale=1.0, pre_tokens=MAX_INT32,
    next_tokens=MAX_INT32, input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0,
    block_size=0, softmax_lse_flag=False, query_rope=None, key_rope=None, key_antiquant_scale=None,
    key_antiquant_offset=None, value_antiquant_scale=None, value_antiquant_offset=None, key_antiquant_mode=0,
    value_antiquant_mode=0,
):
    """Modelled: input_layout "TND" with PageAttention and sparse_mode 3 (what kernels/ascend/ops.py uses).
    query [T, H, D]; key and value caches [N, BS, KVH * D] (BnBsH) or [N, KVH, BS, D] (BnNBsD);
    block_table [B, M] int32; actual_seq_lengths: cumulative query ends; actual_seq_lengths_kv: each
    batch's own context length. Returns (attention_out [T, H, D], softmax_lse)."""
    if query_rope is not None:  # the MLA form (fakes/torch_npu/mla.py)
        return mla_fused_infer_attention_score(
            query, key, value, query_rope, key_rope, num_heads=num_heads, num_key_value_heads=num_key_value_heads,
            input_layout=input_layout, scale=scale, sparse_mode=sparse_mode, block_table=block_table,
            block_size=block_size, actual_seq_lengths=actual_seq_lengths, actual_seq_lengths_kv=actual_seq_lengths_kv,
            atten_mask=atten_mask,
        )
    if key.dtype == torch.int8:  # the int8 KV ("C8") decode form (fakes/torch_npu/kv_int8.py)
        return antiquant_paged_decode(
            query, key, value, key_antiquant_scale=key_antiquant_scale, value_antiquant_scale=value_antiquant_scale,
            key_antiquant_offset=key_antiquant_offset, value_antiquant_offset=value_antiquant_offset,
            key_antiquant_mode=key_antiquant_mode, value_antiquant_mode=value_antiquant_mode, block_table=block_table,
            actual_seq_lengths_kv=actual_seq_lengths_kv, num_heads=num_heads, num_key_value_heads=num_key_value_heads,
            scale=scale, input_layout=input_layout, block_size=block_size,
        )
    op = "aclnnFusedInferAttentionScore"
    if input_layout != "TND" or block_table is None or sparse_mode != 3 or pse_shift is not None \
            or softmax_lse_flag or key_antiquant_scale is not None or value_antiquant_scale is not None:
        raise NotImplementedError("the fake models input_layout 'TND', PageAttention and sparse_mode 3 only")
    _dense(op, "query", query, 3, HALF)
    tokens, heads, head_dim = query.shape
    kv_heads = num_key_value_heads or num_heads
    _check(heads == num_heads, op, f"query has {heads} heads, num_heads is {num_heads}")
    _check(num_heads % kv_heads == 0 and num_heads // kv_heads <= 64, op,
           f"num_heads {num_heads} / num_key_value_heads {kv_heads} must be a whole ratio <= 64")
    _check(head_dim % 8 == 0 and head_dim <= 512, op, f"head dim {head_dim} must be 16-byte aligned, <= 512")
    for name, t in (("key", key), ("value", value)):
        _check(t.dtype == query.dtype and t.is_contiguous(), op, f"{name} must be contiguous {query.dtype}")
        if t.dim() == 3:  # BnBsH
            _check(tuple(t.shape[1:]) == (block_size, kv_heads * head_dim), op,
                   f"{name} {tuple(t.shape)} is not [N, BS {block_size}, KVH * D {kv_heads * head_dim}]")
        else:  # BnNBsD
            _check(t.dim() == 4 and tuple(t.shape[1:]) == (kv_heads, block_size, head_dim), op,
                   f"{name} {tuple(t.shape)} is neither [N, BS, KVH * D] nor [N, KVH, BS, D]")
    _check(key.shape == value.shape, op, "key and value shapes differ")

    q_ends = _int_list("actual_seq_lengths", actual_seq_lengths)
    kv_lens = _int_list("actual_seq_lengths_kv", actual_seq_lengths_kv)
    batch = len(q_ends)
    starts = [0] + q_ends
    _check(0 < batch <= 4096, op, f"TND batch {batch} out of range")
    _check(all(b >= a for a, b in zip(starts, q_ends)), op,
           "actual_seq_lengths must be non-decreasing cumulative ends (TND)")
    _check(q_ends[-1] == tokens, op, f"actual_seq_lengths ends at {q_ends[-1]}, query has {tokens} tokens")
    q_lens = [b - a for a, b in zip(starts, q_ends)]
    _check(len(kv_lens) == batch, op, f"actualSeqLengthsKv has {len(kv_lens)} entries for batch {batch}")
    _dense(op, "block_table", block_table, 2, (torch.int32,))
    _check(block_table.shape[0] == batch, op, f"block_table has {block_table.shape[0]} rows for {batch}")
    if max(q_lens) > 1:
        _check(block_size % 128 == 0 and 128 <= block_size <= 512, op,
               f"block_size {block_size} must be a multiple of 128 in [128, 512] when Q_S > 1")
    else:
        _check(0 < block_size <= 512 and block_size * query.element_size() % 16 == 0, op,
               f"block_size {block_size} unsupported")
    capacity = block_table.shape[1] * block_size
    _check(all(q <= n <= capacity for q, n in zip(q_lens, kv_lens)), op,
           f"actual_seq_lengths_kv {kv_lens} must hold each batch's context length: at least its query "
           f"length {q_lens}, at most {capacity}")
    _check(atten_mask is not None and atten_mask.dtype in (torch.bool, torch.int8, torch.uint8), op,
           "sparse_mode 3 needs the compressed bool / int8 / uint8 mask")
    _check(atten_mask.shape[-2:] == (MASK_SIZE, MASK_SIZE) and atten_mask.numel() == MASK_SIZE**2, op,
           f"sparse_mode 3 needs a (2048, 2048) mask, got {tuple(atten_mask.shape)}")
    # Every 64th row (the whole mask per call would dominate a test's run time)
    sampled = atten_mask.reshape(MASK_SIZE, MASK_SIZE)[::64].bool()
    _check(torch.equal(sampled, UPPER_TRIANGLE[::64]), op,
           "the sparse_mode 3 mask must be 1 strictly above the diagonal and 0 elsewhere")

    # Right-down causal: batch i's queries are the last q_lens[i] of its kv_lens[i] positions.
    if key.dim() == 3:
        key_cache = key.view(key.shape[0], block_size, kv_heads, head_dim)
        value_cache = value.view(value.shape[0], block_size, kv_heads, head_dim)
    else:
        key_cache, value_cache = key.transpose(1, 2).contiguous(), value.transpose(1, 2).contiguous()
    out = reference.paged_prefill_attention(query, key_cache, value_cache, block_table, starts, kv_lens,
                                            scale)
    return out, torch.empty(0, dtype=torch.float32)


# ---- norms, activation, rotary, sampling ----

def npu_rms_norm(self, gamma, epsilon=1e-06):
    """(x / rms(x) * gamma, 1 / rms(x)) over the last dim."""
    op = "aclnnRmsNorm"
    _check(2 <= self.dim() <= 8, op, f"self must have 2-8 dims, got {self.dim()}")
    _check(gamma.dim() == 1 and gamma.shape[0] == self.shape[-1], op,
           f"gamma {tuple(gamma.shape)} must match the last dim of self {tuple(self.shape)}")
    _check(self.dtype in FLOATS and gamma.dtype in (self.dtype, torch.float32), op,
           f"self {self.dtype} with gamma {gamma.dtype} unsupported")
    return reference.rms_norm(self, gamma, epsilon).to(self.dtype), _rstd(self, epsilon)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-06):
    """(rms_norm(x1 + x2) * gamma, 1 / rms, x1 + x2) over the last dim."""
    op = "aclnnAddRmsNorm"
    _check(x1.shape == x2.shape and x1.dtype == x2.dtype == gamma.dtype and x1.dtype in FLOATS, op,
           f"x1 {x1.dtype}{tuple(x1.shape)}, x2 {x2.dtype}{tuple(x2.shape)}, gamma {gamma.dtype} must agree")
    _check(1 <= x1.dim() <= 8 and x1.numel() > 0, op, "x1 must be non-empty with 1-8 dims")
    _check(gamma.dim() == 1 and gamma.shape[0] == x1.shape[-1], op, "gamma must match the last dim")
    normed, added = reference.rms_norm(x1, gamma, epsilon, x2)
    return normed, _rstd(added, epsilon), added


def _rstd(x: torch.Tensor, epsilon: float) -> torch.Tensor:
    return torch.rsqrt(x.float().pow(2).mean(dim=-1, keepdim=True) + epsilon)


def npu_swiglu(self, dim=-1):
    """silu(A) * B, where A and B are the first and second halves of ``self`` along ``dim``."""
    op = "aclnnSwiGlu"
    _check(self.dtype in FLOATS and self.is_contiguous() and self.numel() > 0, op,
           f"input must be a non-empty contiguous float tensor, got {self.dtype}")
    _check(self.shape[dim] % 2 == 0, op, f"dim {dim} of {tuple(self.shape)} must be even")
    gate, up = self.chunk(2, dim=dim)
    return F.silu(gate) * up


def npu_mrope(positions, query, key, cos_sin_cache, head_size, *, mrope_section=None, rotary_mode="half",
              cache_mode="default"):
    """Plain RoPE (1-D positions; mrope_section None or [0, 0, 0]) on query [T, Hq * head_size] and
    key [T, Hk * head_size]: the first rotary_dim (the cache's width) dims of each head turn,
    paired as halves ("half", NeoX) or neighbours ("interleaved", GPT-J); the rest pass through."""
    op = "aclnnRopeWithSinCosCache"
    if mrope_section not in (None, [0, 0, 0]) or positions.dim() != 1:
        raise NotImplementedError("the fake models plain RoPE only (1-D positions)")
    _check(positions.dtype in (torch.int32, torch.int64), op, f"positions dtype {positions.dtype}")
    _check(rotary_mode in ("half", "interleaved"), op, f"rotary_mode {rotary_mode!r}")
    _check(cache_mode == "default", op, "plain RoPE supports cache_mode 'default' only")
    _check(query.dim() == 2 and key.dim() == 2 and cos_sin_cache.dim() == 2, op,
           "query, key [T, heads * head_size] and cos_sin_cache [max_seq_len, rotary_dim] must be 2-D")
    _check(query.dtype == key.dtype == cos_sin_cache.dtype and query.dtype in FLOATS, op,
           f"query {query.dtype}, key {key.dtype} and cos_sin_cache {cos_sin_cache.dtype} must share a "
           "float dtype")
    rotary_dim = cos_sin_cache.shape[1]
    multiple = 16 if query.dtype == torch.float32 else 32
    _check(head_size % multiple == 0 and rotary_dim % multiple == 0 and rotary_dim <= head_size, op,
           f"head_size {head_size} / rotary_dim {rotary_dim} must be multiples of {multiple}, rotary <= head")
    _check(query.shape[1] % head_size == 0 and key.shape[1] % head_size == 0, op, "widths not whole heads")
    _check(positions.shape[0] == query.shape[0] == key.shape[0], op, "one position per token")
    _check(bool(((positions >= 0) & (positions < cos_sin_cache.shape[0])).all()), op, "position out of range")
    is_neox = rotary_mode == "half"
    table = reference.rotary_cos_sin(positions.long(), cos_sin_cache, is_neox, query.dtype)
    tokens = query.shape[0]
    q, k = reference.rotary_embedding(query.view(tokens, -1, head_size), key.view(tokens, -1, head_size),
                                      table, is_neox)
    return q.reshape(query.shape), k.reshape(key.shape)


def npu_top_k_top_p(logits, p=None, k=None):
    """Top-k then top-p filtering of logits [N, V]: filtered entries become -inf.

    k: [N] int32. The documentation states k in [1, 1024]; vllm-ascend passes k = V to disable
    top-k, so the fake accepts [1, V]. p: [N] in the logits' dtype."""
    op = "aclnnApplyTopKTopP"
    _check(logits.dim() == 2 and logits.dtype in FLOATS, op, f"logits must be 2-D float, got {logits.dtype}")
    batch, vocab = logits.shape
    if k is None:
        k = torch.full((batch,), vocab, dtype=torch.int32)
    if p is None:
        p = torch.ones(batch, dtype=logits.dtype)
    _check(k.dim() == 1 and k.shape[0] == batch and k.dtype == torch.int32, op,
           f"k must be [{batch}] int32, got {k.dtype}{tuple(k.shape)}")
    _check(bool(((k >= 1) & (k <= vocab)).all()), op, "k out of range")
    _check(p.dim() == 1 and p.shape[0] == batch and p.dtype == logits.dtype, op,
           f"p must be [{batch}] {logits.dtype}, got {p.dtype}{tuple(p.shape)}")
    # k = V keeps every token, as the reference's k = 0 does.
    filtered = reference.top_k_top_p(logits.float(), k.long()[:, None], p.float()[:, None])
    return filtered.to(logits.dtype)


# ---- mixture of experts (MoeGatingTopK, MoeInitRoutingV2, GroupedMatmul, MoeTokenUnpermute) ----

def npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=0,
                         out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    """Per row of x [T, E]: scores = softmax (norm_type 0) or sigmoid (1) of x; the top k experts by
    scores + bias, among the best k_group of group_count groups; y = their unbiased scores, divided
    by their sum + eps when sigmoid, times routed_scaling_factor. Returns (y [T, k] in x's dtype,
    expert_idx [T, k] int32, out: the scores [T, E] float32 when out_flag, else empty)."""
    op = "aclnnMoeGatingTopK"
    if group_select_mode != 1 and group_count > 1 or eps != 1e-20:
        raise NotImplementedError("the fake models group_select_mode 1 (top-2 sum) and eps 1e-20 only")
    _check(x.dim() == 2 and x.dtype in FLOATS, op, f"x must be 2-D float16 / bfloat16 / float32, got {x.dtype}")
    experts = x.shape[1]
    _check(bias is None or (bias.dim() == 1 and bias.shape[0] == experts and bias.dtype == x.dtype), op,
           f"bias must be [{experts}] {x.dtype}")
    _check(experts <= 2048 and group_count > 0 and experts % group_count == 0, op,
           f"{experts} experts must be <= 2048 and divide into {group_count} groups")
    width = experts // group_count
    _check(width > group_select_mode and -(-width // 32) * 32 * group_count <= 2048, op,
           f"groups of {width} experts unsupported")
    _check(1 <= k_group <= group_count and 1 <= k <= width * k_group, op,
           f"k {k} / k_group {k_group} out of range for {group_count} groups of {width}")
    _check(renorm == 0, op, "renorm only supports 0")
    _check(norm_type in (0, 1), op, f"norm_type {norm_type} unsupported")
    routing = MoeRouting(top_k=k, scoring="softmax" if norm_type == 0 else "sigmoid", renormalize=norm_type == 1,
                         num_groups=group_count, topk_groups=k_group, correction_bias=bias is not None,
                         scaling_factor=routed_scaling_factor)
    scores = x.float()
    weights, ids = reference.select_experts(scores, routing, None if bias is None else bias.float())
    out = (scores.softmax(-1) if norm_type == 0 else scores.sigmoid()) if out_flag else torch.empty(0)
    return weights.to(x.dtype), ids.to(torch.int32), out


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=0, active_expert_range=[], row_idx_type=0):  # noqa: B006  the binding's default
    """Sort the T * K (token, expert) rows of expert_idx [T, K] by expert (stably). Returns
    (expanded_x [T * K, H]: row i is x of sorted row i's token; expanded_row_idx [T * K] int32: with
    row_idx_type 0 where each (token, k) row went (a gather index), with 1 which row each sorted
    position holds; the expert token counts [E] int64 (type 1) or their running sum (type 0);
    expanded_scale, undefined without quantisation)."""
    op = "aclnnMoeInitRoutingV2"
    if quant_mode != -1 or scale is not None or offset is not None or drop_pad_mode != 0:
        raise NotImplementedError("the fake models the unquantised, dropless routing only (quant_mode -1)")
    _check(x.dim() == 2 and x.dtype in FLOATS, op, f"x must be 2-D float, got {x.dtype}{tuple(x.shape)}")
    _check(expert_idx.dim() == 2 and expert_idx.dtype == torch.int32 and expert_idx.shape[0] == x.shape[0], op,
           f"expert_idx must be [{x.shape[0]}, K] int32, got {expert_idx.dtype}{tuple(expert_idx.shape)}")
    rows = expert_idx.numel()
    _check(active_num == rows, op, f"the fake models active_num = T * K ({rows}) only, got {active_num}")
    _check(expert_num > 0 and list(active_expert_range) == [0, expert_num], op,
           f"active_expert_range {active_expert_range} must cover the {expert_num} experts (no expert parallelism)")
    _check(bool(((expert_idx >= 0) & (expert_idx < expert_num)).all()), op, "expert id out of range")
    _check(expert_tokens_num_flag and expert_tokens_num_type in (0, 1), op,
           "the expert token counts (type 1) or cumsum (type 0) must be requested")
    _check(row_idx_type in (0, 1), op, f"row_idx_type {row_idx_type}")
    flat = expert_idx.reshape(-1).long()
    sorted_rows = flat.argsort(stable=True)  # sorted position -> (token, k) row
    expanded_x = x.index_select(0, sorted_rows // expert_idx.shape[1])
    if row_idx_type == 0:
        row_idx = torch.empty_like(sorted_rows).scatter_(0, sorted_rows, torch.arange(rows))
    else:
        row_idx = sorted_rows
    counts = torch.bincount(flat, minlength=expert_num)
    counts = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
    return expanded_x, row_idx.to(torch.int32), counts, torch.empty(0, dtype=torch.float32)


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item=0, group_type=-1,
                       group_list_type=0, act_type=0, output_dtype=None):
    """Modelled: one x [M, K] split along M (group_type 0) by group_list (an int64 tensor of counts,
    group_list_type 1, or their running sum, 0) over one weight [E, K, N], whose group g multiplies
    its rows; one output [M, N] (split_item 2 or 3). The weight may be contiguous or the transpose
    of a contiguous [E, N, K] (its last two dims swapped)."""
    op = "aclnnGroupedMatmulV4"
    if not isinstance(x, (list, tuple)) or not isinstance(weight, (list, tuple)):
        raise TypeError("npu_grouped_matmul(): arguments 'x' and 'weight' must be lists of tensors")
    if scale is not None and per_token_scale is not None:  # int8 x and weights (tests/fakes/torch_npu/quant.py)
        _check(split_item in (2, 3) and group_type == 0 and len(x) == len(weight) == 1, op,
               "one output split along M needs split_item 2 / 3, group_type 0")
        ends = _group_ends(op, group_list, group_list_type, weight[0].shape[0], x[0].shape[0])
        return [grouped_matmul_int8(x[0], weight[0], scale[0], per_token_scale[0], ends, output_dtype)]
    quantised = (bias, scale, offset, antiquant_scale, antiquant_offset, per_token_scale, activation_input)
    if len(x) != 1 or len(weight) != 1 or any(t is not None for t in quantised) or act_type != 0:
        raise NotImplementedError("the fake models one x, one 3-D weight, no bias, no quantisation")
    (a,), (w,) = x, weight
    _check(split_item in (2, 3) and group_type == 0, op, "one output split along M needs split_item 2 / 3, "
                                                          "group_type 0")
    _check(a.dim() == 2 and a.dtype in FLOATS and a.is_contiguous(), op,
           f"x must be a contiguous 2-D float tensor, got {a.dtype}{tuple(a.shape)}")
    _check(w.dim() == 3 and w.dtype == a.dtype, op, f"weight must be 3-D {a.dtype}, got {w.dtype}{tuple(w.shape)}")
    experts, k, n = w.shape
    transposed = w.stride() == (k * n, 1, k)
    _check(w.is_contiguous() or transposed, op, f"weight strides {w.stride()} are neither ND nor transposed ND")
    _check(a.shape[1] == k, op, f"x {tuple(a.shape)} and weight {tuple(w.shape)} do not multiply")
    _check(output_dtype in (None, a.dtype), op, f"output_dtype {output_dtype} unsupported without quantisation")
    out, start = torch.empty(a.shape[0], n, dtype=a.dtype), 0
    for expert, end in enumerate(_group_ends(op, group_list, group_list_type, experts, a.shape[0])):
        out[start:end] = a[start:end] @ w[expert]
        start = end
    return [out]


def _group_ends(op: str, group_list: object, group_list_type: int, experts: int, rows: int) -> list[int]:
    """Where each group's rows end: group_list an [E] int64 tensor of counts (type 1) or their running
    sum (type 0), which must split all ``rows``."""
    _check(isinstance(group_list, torch.Tensor) and group_list.dtype == torch.int64
           and group_list.shape == (experts,), op, f"group_list must be an [{experts}] int64 tensor")
    _check(group_list_type in (0, 1), op, f"group_list_type {group_list_type}")
    ends = group_list.cumsum(0) if group_list_type == 1 else group_list
    _check(bool((group_list >= 0).all()) and bool((ends[1:] >= ends[:-1]).all()) and int(ends[-1]) == rows,
           op, f"group_list {group_list.tolist()} does not split the {rows} rows of x")
    return ends.tolist()


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """out[t] = sum over k of permuted_tokens[sorted_indices[t * K + k]] * probs[t, k], with
    permuted_tokens [T * K, H], sorted_indices [T * K] int32 (a permutation), probs [T, K] in the
    tokens' dtype (K = 1 without probs). Returns [T, H]."""
    op = "aclnnMoeTokenUnpermute"
    if padded_mode or restore_shape is not None:
        raise NotImplementedError("the fake models padded_mode False only")
    _check(permuted_tokens.dim() == 2 and permuted_tokens.dtype in FLOATS, op,
           f"permuted_tokens must be 2-D float, got {permuted_tokens.dtype}")
    rows = permuted_tokens.shape[0]
    _check(sorted_indices.dim() == 1 and sorted_indices.dtype == torch.int32 and sorted_indices.shape[0] == rows, op,
           f"sorted_indices must be [{rows}] int32, got {sorted_indices.dtype}{tuple(sorted_indices.shape)}")
    _check(torch.equal(sorted_indices.sort().values, torch.arange(rows, dtype=torch.int32)), op,
           "sorted_indices must be a permutation of the rows")
    top_k = 1 if probs is None else probs.shape[1]
    _check(probs is None or (probs.dim() == 2 and probs.numel() == rows and probs.dtype == permuted_tokens.dtype),
           op, f"probs must be [{rows} / K, K] {permuted_tokens.dtype}")
    gathered = permuted_tokens.index_select(0, sorted_indices.long()).float().view(-1, top_k, permuted_tokens.shape[1])
    if probs is not None:
        gathered = gathered * probs.float()[:, :, None]
    return gathered.sum(dim=1).to(permuted_tokens.dtype)
