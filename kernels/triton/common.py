"""What the Triton kernels share: tile extents, and whether Triton runs a kernel in its CPU interpreter."""

import torch
import triton


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


def keys_tile(keys: int, dim_tile: int, cache: torch.Tensor) -> int:
    """Keys per inner step: ``keys``, fewer when a [keys, dim_tile] K/V tile of the cache dtype
    would pass 16 KB (D 128 in bf16). The kernels' software pipeline holds several such tiles in
    shared memory; at 32 KB (fp32, D 128) prefill needs ~115 KB, past the ~100 KB per SM of sm_86
    and sm_89 GPUs."""
    return max(16, min(keys, 16384 // (dim_tile * cache.element_size())))
