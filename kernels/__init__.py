"""Kernels the models call. Models look these names up on this module at call time
(``kernels.write_kv(...)``), so rebinding a name here swaps the implementation everywhere."""

from kernels.reference import (
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    rotary_cos_sin,
    rotary_embedding,
    silu_and_mul,
    write_kv,
)

__all__ = [
    "paged_decode_attention",
    "paged_prefill_attention",
    "rms_norm",
    "rotary_cos_sin",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv",
]
