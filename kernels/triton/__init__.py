"""Triton kernels, drop-in for the references of the same names in kernels/references/dense.py: KV write,
paged decode attention (split-K flash-decoding) and varlen prefill attention after a cached prefix,
``quant_linear`` (a GEMM dequantizing quantized weights tile by tile), multi-LoRA's ``lora_shrink`` /
``lora_expand`` (kernels/triton/lora.py), and the fused elementwise ops of a decoder layer and the sampler:
RMSNorm with the residual add, rotary on query and key in one launch, SiLU-and-mul, and top-k / top-p
without a sort (norm.py, rotary.py, activation.py, sampling.py). They run on any device with a Triton
backend, and on CPU tensors under Triton's interpreter when TRITON_INTERPRET=1 is set before this package is
imported.
Importing it raises ImportError where Triton is not installed."""

import torch

from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.triton.activation import silu_and_mul
from xinserve.kernels.triton.decode_attention import paged_decode_attention
from xinserve.kernels.triton.kv_write import write_kv
from xinserve.kernels.triton.lora import lora_expand, lora_shrink
from xinserve.kernels.triton.norm import MAX_SIZE as RMS_NORM_MAX_SIZE
from xinserve.kernels.triton.norm import rms_norm
from xinserve.kernels.triton.prefill_attention import paged_prefill_attention
from xinserve.kernels.triton.quant_gemm import prepare_quant_weight, quant_linear
from xinserve.kernels.triton.rotary import rotary_cos_sin, rotary_embedding
from xinserve.kernels.triton.sampling import top_k_top_p

# function name -> function, as every implementation module exposes (kernels/ops.py)
OPS = {fn.__name__: fn for fn in (write_kv, paged_prefill_attention, paged_decode_attention, prepare_quant_weight,
                                  quant_linear, lora_shrink, lora_expand, rms_norm, rotary_cos_sin, rotary_embedding,
                                  silu_and_mul, top_k_top_p)}


def unsupported(op: str, shapes: ModelShapes, dtype: torch.dtype) -> str | None:
    """Why these kernels cannot serve ``op`` for the model, or None (the registry then probes them)."""
    if op in ("write_kv", "prefill_attention", "decode_attention") and shapes.kv_cache_dtype not in (None, dtype):
        return f"KV cache dtype {shapes.kv_cache_dtype} unsupported (its kernels read a cache in the model's dtype)"
    if op in ("prefill_attention", "decode_attention") and shapes.sliding_window is not None:
        return "sliding window unsupported (the Triton attention kernels attend to the whole context)"
    if op == "rms_norm" and max(shapes.hidden_size, shapes.head_dim) > RMS_NORM_MAX_SIZE:
        return (f"hidden size {max(shapes.hidden_size, shapes.head_dim)} unsupported (one row per program, "
                f"at most {RMS_NORM_MAX_SIZE})")
    if op == "rotary" and shapes.rotary_dim % 2:
        return f"rotary_dim {shapes.rotary_dim} unsupported (odd: its dims cannot pair up)"
    return None


__all__ = ["OPS", "lora_expand", "lora_shrink", "paged_decode_attention", "paged_prefill_attention",
           "prepare_quant_weight", "quant_linear", "rms_norm", "rotary_cos_sin", "rotary_embedding", "silu_and_mul",
           "top_k_top_p", "unsupported", "write_kv"]
