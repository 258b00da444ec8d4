"""Triton KV write: scatter this step's keys and values into the paged caches, in place.

One program per new token copies its [KVH, D] key and value rows to the token's slot
(block = slot // BS, offset = slot % BS). Shape letters as in kernels/references/dense.py.
"""

import torch

import triton
import triton.language as tl
from xinserve.kernels.triton.common import cache_strides


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    k_stride_t, k_stride_h, k_stride_d, v_stride_t, v_stride_h, v_stride_d,
    cache_stride_n, cache_stride_bs, cache_stride_h, cache_stride_d,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, HEADS_TILE: tl.constexpr, DIM_TILE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_TILE)[:, None]  # [HEADS_TILE, 1]
    dims = tl.arange(0, DIM_TILE)[None, :]  # [1, DIM_TILE]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    k = tl.load(k_ptr + token * k_stride_t + heads * k_stride_h + dims * k_stride_d, mask=mask)
    v = tl.load(v_ptr + token * v_stride_t + heads * v_stride_h + dims * v_stride_d, mask=mask)
    within = block * cache_stride_n + offset * cache_stride_bs + heads * cache_stride_h + dims * cache_stride_d
    # .to: the reference casts the new keys/values to the cache dtype
    tl.store(k_cache_ptr + within, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + within, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """``xinserve.kernels.references.dense.write_kv`` in Triton. key, value: [T, KVH, D] (any strides);
    key_cache, value_cache: [N, BS, KVH, D]; slot_mapping: [T] int64."""
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        *key.stride(), *value.stride(), *cache_strides(key_cache, value_cache),
        num_kv_heads, head_dim,
        BLOCK_SIZE=block_size,
        HEADS_TILE=triton.next_power_of_2(num_kv_heads),
        DIM_TILE=triton.next_power_of_2(head_dim),
    )
