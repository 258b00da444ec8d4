"""What one adapter slot costs on each device: ``xinserve plan`` multiplies it by ``max_loras``."""

from typing import Any

import torch

from xinserve.engines.models.tensor_parallel import HeadSplit


def lora_slot_bytes(hf_config: Any, max_lora_rank: int, dtype: torch.dtype, tensor_parallel_size: int = 1) -> int:
    """One device slot's bytes across all layers on one rank (engines/lora/stacks.py's layout: A and B of
    qkv_proj, o_proj and, on dense-MLP layers, gate_up_proj and down_proj, padded to ``max_lora_rank``; on
    mixture-of-experts layers without tensor parallel, every routed expert's A and B of gate_up_proj and
    down_proj, engines/lora/expert_stacks.py)."""
    from xinserve.engines.models import MODEL_REGISTRY

    tp, r = tensor_parallel_size, max_lora_rank
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    split = HeadSplit.of(hf_config.num_attention_heads, hf_config.num_key_value_heads, 0, tp)
    hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
    q_local, kv_local = split.num_heads * head_dim, split.num_kv_heads * head_dim
    attention = 3 * r * hidden + (q_local + 2 * kv_local) * 3 * r + r * q_local + hidden * r
    mlp = 2 * r * hidden + 2 * (inter // tp) * 2 * r + r * (inter // tp) + hidden * r
    architecture = (getattr(hf_config, "architectures", None) or [None])[0]
    model_cls = MODEL_REGISTRY.get(architecture)
    spec = model_cls.spec(hf_config) if model_cls is not None else None
    moe_layers = spec.moe_layers if spec is not None else frozenset()
    layers = hf_config.num_hidden_layers
    elements = layers * attention + (layers - len(moe_layers)) * mlp
    if moe_layers and tp == 1:  # a13, b13, a2, b2 per expert
        expert_inter = spec.moe.intermediate_size
        elements += len(moe_layers) * spec.moe.num_experts * r * (2 * hidden + 3 * expert_inter)
    return elements * torch.empty(0, dtype=dtype).element_size()
