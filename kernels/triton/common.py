"""What the Triton kernels share: tile extents, and whether Triton runs a kernel in its CPU interpreter."""

import torch

import triton
import triton.language as tl


def interpreted(kernel: object) -> bool:
    """Whether ``@triton.jit`` made ``kernel`` an interpreted function (TRITON_INTERPRET=1 was set
    when it was decorated, i.e. when its module was imported) rather than a compiled one.

    The interpreter keeps bf16 as raw uint16 and its tl.dot multiplies those integers, so
    interpreted kernels widen their dot operands to fp32; compiled ones keep the cache dtype for the
    tensor cores."""
    return not isinstance(kernel, triton.runtime.JITFunction)


def tile(n: int) -> int:
    """The tile extent covering n rows or columns: a power of two (tl.arange needs one) of at least 16
    (tl.dot's smallest operand side); the padding is masked on load and never stored."""
    return max(16, triton.next_power_of_2(n))


def warps_for(tile_elements: int) -> int:
    """Warps for a program that holds a tile of this many elements: about 16 per thread, 1 to 16 warps."""
    return min(16, max(1, tile_elements // 512))


def cache_strides(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[int, ...]:
    """The one layout of both paged caches ([N, BS, KVH, D] views of one KV tensor): the kernels address
    a key and its value with the same offsets."""
    if key_cache.stride() != value_cache.stride():
        raise ValueError(f"key and value caches differ in layout: strides {key_cache.stride()} and "
                         f"{value_cache.stride()}")
    return key_cache.stride()


def keys_tile(keys: int, dim_tile: int, cache: torch.Tensor) -> int:
    """Keys per inner step: ``keys``, fewer when a [keys, dim_tile] K/V tile of the cache dtype
    would pass 16 KB (D 128 in bf16). The kernels' software pipeline holds several such tiles in
    shared memory; at 32 KB (fp32, D 128) prefill needs ~115 KB, past the ~100 KB per SM of sm_86
    and sm_89 GPUs."""
    return max(16, min(keys, 16384 // (dim_tile * cache.element_size())))


@triton.jit
def load_kv_tile(
    key_cache_ptr, value_cache_ptr, kv_head, table_base, keys, key_mask, dims, dim_mask,
    cache_stride_n, cache_stride_bs, cache_stride_h, cache_stride_d, bt_stride_b,
    BLOCK_SIZE: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    """The K and V tiles [len(keys), DIM_TILE] of positions ``keys`` (masked by key_mask and
    dim_mask) of one sequence and KV head ``kv_head`` of the caches; table_base points at the
    sequence's block table row; each key's block is looked up there."""
    # [keys, 1] each key's block and offset in it; int64: block * stride can pass 2**31
    blocks = tl.load(table_base + (keys // BLOCK_SIZE) * bt_stride_b, mask=key_mask, other=0).to(tl.int64)[:, None]
    offsets = (keys % BLOCK_SIZE)[:, None]
    kv_mask = key_mask[:, None] & dim_mask[None, :]
    within = blocks * cache_stride_n + offsets * cache_stride_bs + kv_head * cache_stride_h + dims[None, :] * cache_stride_d
    k = tl.load(key_cache_ptr + within, mask=kv_mask, other=0.0)
    v = tl.load(value_cache_ptr + within, mask=kv_mask, other=0.0)
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def online_softmax_step(q, k, v, visible, qk_scale, row_max, row_sum, acc):
    """One K/V tile of an online softmax in base 2 (qk_scale includes log2(e)): q [R, D], k, v [L, D],
    visible [R, L]; returns the updated running max [R], sum [R] and unnormalised output [R, D].
    The first tile must hold a visible key for every row (its alpha is then 0)."""
    # scores: [R, L]; "ieee" keeps fp32 inputs out of TF32 (16-bit ones ignore it)
    scores = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    scores = tl.where(visible, scores, float("-inf"))
    new_max = tl.maximum(row_max, tl.max(scores, 1))
    alpha = tl.exp2(row_max - new_max)
    p = tl.exp2(scores - new_max[:, None])
    row_sum = row_sum * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return new_max, row_sum, acc


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to nearest-even in ``dtype``, as torch rounds. bfloat16 is rounded on the bits:
    Triton's interpreter truncates float32 to bfloat16 (a compiled kernel rounds to nearest either way), and
    a fused kernel that rounds where the reference rounds must round the same way to agree with it."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # round the low 16 bits away, ties to even
        return bits.to(tl.float32, bitcast=True).to(dtype)
    return x.to(dtype)
