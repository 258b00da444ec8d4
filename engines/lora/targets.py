"""Which modules of a model an adapter may target, and their full (unsharded) shapes.

An adapter's module is named as PEFT's key without its prefix: ``layers.<i>.self_attn.q_proj``,
``layers.<i>.mlp.down_proj``. Attention projections are served on every layer, the MLP's on dense layers;
a mixture-of-experts layer's experts, shared experts and router are refused by name.
"""

from dataclasses import dataclass
from typing import Any

from torch import nn

from xinserve.engines.models.layers import Attention, GatedMLP

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
PEFT_MODULES = ATTENTION_MODULES + MLP_MODULES
# PEFT projection -> (our fused projection, its slice); o_proj and down_proj are not fused
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
         "down_proj": ("down_proj", 0)}


@dataclass(frozen=True, slots=True)
class ModelTargets:
    num_layers: int
    dense_layers: frozenset[int]  # layers with a dense MLP (the others are mixture-of-experts)
    shapes: dict[str, tuple[int, int]]  # PEFT projection -> (in_features, out_features)

    @classmethod
    def of(cls, model: nn.Module) -> "ModelTargets":
        """The targets of a ``CausalLM``; ValueError for a model whose attention is not served (MLA)."""
        config: Any = model.config
        layers = model.model.layers
        if not all(isinstance(layer.self_attn, Attention) for layer in layers):
            raise ValueError(f"LoRA adapters are not supported on {type(model).__name__} yet "
                             "(multi-head latent attention)")
        head_dim = model.head_dim
        q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
        hidden, inter = config.hidden_size, config.intermediate_size
        shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
                  "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
        dense = frozenset(i for i, layer in enumerate(layers) if isinstance(layer.mlp, GatedMLP))
        return cls(len(layers), dense, shapes)

    def module_name(self, path: str, layer: int, inner: str) -> str:
        """``layers.<layer>.<inner>`` when served; ValueError naming it otherwise."""
        name = f"layers.{layer}.{inner}"
        if layer >= self.num_layers:
            raise ValueError(f"LoRA adapter {path!r}: {name}: the model has {self.num_layers} layers")
        block, _, proj = inner.partition(".")
        if block == "self_attn" and proj in ATTENTION_MODULES:
            return name
        if block == "mlp" and proj in MLP_MODULES and layer in self.dense_layers:
            return name
        if block == "mlp" and layer not in self.dense_layers:
            raise ValueError(f"LoRA adapter {path!r}: {name} is a mixture-of-experts module: LoRA on experts, "
                             "shared experts or the router is not served (attention and dense MLP layers only)")
        raise ValueError(f"LoRA adapter {path!r}: target {name} is not served "
                         f"(served: {', '.join(PEFT_MODULES)})")

    def shape(self, module: str) -> tuple[int, int]:
        return self.shapes[module.rsplit(".", 1)[1]]
