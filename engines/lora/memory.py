"""What one LoRA adapter slot costs on a device: the stacked A and B weights of every layer's
projections at ``max_lora_rank``, in the model's dtype (``xinserve plan`` multiplies it by ``max_loras``).

A slot holds every target module the engine serves (q, k, v, o, gate, up, down): a merged projection
(qkv_proj, gate_up_proj) stacks its slices' A along the rank, ``A [slices * R, in]``, and holds a
block-diagonal ``B [out, slices * R]``. Tensor parallel splits them like their base layers: a
column-parallel layer's B by its output rows, a row-parallel layer's A by its input columns.
"""

from typing import Any

import torch


def _split(n: int, tp: int) -> int:
    return -(-n // tp)


def lora_slot_bytes(hf_config: Any, max_lora_rank: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """One device slot's bytes across all layers, on one of ``tensor_parallel_size`` ranks."""
    r, tp = max_lora_rank, tensor_parallel_size
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = (
        3 * r * hidden + _split(q + 2 * kv, tp) * 3 * r  # qkv_proj (column parallel)
        + r * _split(q, tp) + hidden * r  # o_proj (row parallel)
        + 2 * r * hidden + _split(2 * inter, tp) * 2 * r  # gate_up_proj (column parallel)
        + r * _split(inter, tp) + hidden * r  # down_proj (row parallel)
    )
    return per_layer * hf_config.num_hidden_layers * torch.empty((), dtype=dtype).element_size()
