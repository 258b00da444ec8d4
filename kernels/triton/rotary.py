"""Triton rotary embedding: query and key rotated in one launch, one program per token for its query heads
and one for its key heads.

It reads the reference's table (``rotary_cos_sin`` of kernels/references/dense.py, reused as it is:
[2, T, 1, rotary_dim], row 0 each pair's cos, row 1 its sin signed for the pair's first element, both in
the pairing order of the style), so element i of a head becomes x[i] * cos[i] + x[partner(i)] * sin[i]
with partner(i) = i +- rotary_dim / 2 (neox) or i ^ 1 (GPT-J / GLM); dims past rotary_dim are copied.
Out of place like the reference.
"""

import torch

import triton
import triton.language as tl
from xinserve.kernels.references.dense import rotary_cos_sin
from xinserve.kernels.triton.common import rounded, warps_for


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, token, x_stride_t, x_stride_h, out_stride_t, out_stride_h, num_heads,
    cos_ptr, sin_ptr, rotary_dim, head_dim,
    IS_NEOX: tl.constexpr, HEADS_TILE: tl.constexpr, DIM_TILE: tl.constexpr,
):
    """All heads of one token of query or key: a [HEADS_TILE, DIM_TILE] tile."""
    heads = tl.arange(0, HEADS_TILE)[:, None]  # [HEADS_TILE, 1]
    dims = tl.arange(0, DIM_TILE)  # [DIM_TILE]
    half = rotary_dim // 2
    if IS_NEOX:
        partner = tl.where(dims < half, dims + half, dims - half)
    else:
        partner = dims ^ 1
    rotated = dims < rotary_dim
    in_head = (heads < num_heads) & (dims < head_dim)[None, :]
    row = x_ptr + token * x_stride_t + heads * x_stride_h  # [HEADS_TILE, 1]
    x = tl.load(row + dims[None, :], mask=in_head, other=0.0).to(tl.float32)
    swapped = tl.load(row + partner[None, :], mask=in_head & rotated[None, :], other=0.0).to(tl.float32)
    # [1, DIM_TILE], broadcast over heads; 1 and 0 past rotary_dim make the rotation a copy there
    cos = tl.load(cos_ptr + dims, mask=rotated, other=1.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + dims, mask=rotated, other=0.0).to(tl.float32)[None, :]
    # each product rounded to the output dtype, then their sum: the reference's roundings, bit for bit
    dtype = out_ptr.dtype.element_ty
    out = rounded(x * cos, dtype).to(tl.float32) + rounded(swapped * sin, dtype).to(tl.float32)
    tl.store(out_ptr + token * out_stride_t + heads * out_stride_h + dims[None, :], rounded(out, dtype), mask=in_head)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, table_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, q_out_stride_t, q_out_stride_h, k_out_stride_t, k_out_stride_h,
    table_stride_row, table_stride_t,
    num_heads, num_kv_heads, rotary_dim, head_dim,
    IS_NEOX: tl.constexpr, HEADS_TILE: tl.constexpr, DIM_TILE: tl.constexpr,
):
    # grid: (T, 2): program (t, 0) rotates token t's query heads, (t, 1) its key heads
    token = tl.program_id(0).to(tl.int64)
    cos_ptr = table_ptr + token * table_stride_t
    sin_ptr = cos_ptr + table_stride_row
    if tl.program_id(1) == 0:
        _rotate_heads(q_ptr, q_out_ptr, token, q_stride_t, q_stride_h, q_out_stride_t, q_out_stride_h, num_heads,
                      cos_ptr, sin_ptr, rotary_dim, head_dim, IS_NEOX, HEADS_TILE, DIM_TILE)
    else:
        _rotate_heads(k_ptr, k_out_ptr, token, k_stride_t, k_stride_h, k_out_stride_t, k_out_stride_h, num_kv_heads,
                      cos_ptr, sin_ptr, rotary_dim, head_dim, IS_NEOX, HEADS_TILE, DIM_TILE)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor, is_neox: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``xinserve.kernels.references.dense.rotary_embedding`` in Triton. query: [T, H, D], key: [T, KVH, D]
    (any strides: slices of the fused qkv projection); cos_sin: ``rotary_cos_sin``'s [2, T, 1, rotary_dim].
    Returns the rotated (query, key), new contiguous tensors."""
    query, key, table = _unit_last(query), _unit_last(key), _unit_last(cos_sin)
    num_tokens, num_heads, head_dim = query.shape
    rotary_dim = table.shape[-1]
    q_out = torch.empty(query.shape, dtype=torch.promote_types(query.dtype, table.dtype), device=query.device)
    k_out = torch.empty(key.shape, dtype=torch.promote_types(key.dtype, table.dtype), device=key.device)
    heads_tile, dim_tile = triton.next_power_of_2(max(num_heads, key.shape[1])), triton.next_power_of_2(head_dim)
    if num_tokens:
        _rotary_kernel[(num_tokens, 2)](
            query, key, q_out, k_out, table,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            table.stride(0), table.stride(1),
            num_heads, key.shape[1], rotary_dim, head_dim,
            IS_NEOX=is_neox, HEADS_TILE=heads_tile, DIM_TILE=dim_tile, num_warps=warps_for(heads_tile * dim_tile),
        )
    return q_out, k_out


__all__ = ["rotary_cos_sin", "rotary_embedding"]
