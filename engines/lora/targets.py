"""Which modules of a model an adapter may target, and their full (unsharded) shapes.

An adapter's module is named as PEFT's key without its prefix: ``layers.<i>.self_attn.q_proj``,
``layers.<i>.mlp.down_proj``; the routed experts' parameters ``layers.<i>.mlp.experts.gate_up_proj`` /
``.down_proj`` (engines/lora/expert_checkpoint.py). Attention projections are served on every layer, the
MLP's on dense layers, the routed experts' on mixture-of-experts layers whose experts are whole on this
device (not tensor- or expert-parallel, not quantized); shared experts and the router are refused by name.
"""

from dataclasses import dataclass
from typing import Any

from torch import nn

from xinserve.engines.models.layers import Attention, GatedMLP
from xinserve.engines.models.moe import Experts

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
PEFT_MODULES = ATTENTION_MODULES + MLP_MODULES
# a checkpoint's own fused projection (GLM-4's MLP) -> the modules whose rows it stacks, in order
CHECKPOINT_FUSED = {"gate_up_proj": ("gate_proj", "up_proj")}
# PEFT projection -> (our fused projection, its slice); o_proj and down_proj are not fused
FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "o_proj": ("o_proj", 0), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
         "down_proj": ("down_proj", 0)}


@dataclass(frozen=True, slots=True)
class ModelTargets:
    num_layers: int
    dense_layers: frozenset[int]  # layers with a dense MLP (the others are mixture-of-experts)
    shapes: dict[str, tuple[int, int]]  # PEFT projection -> (in_features, out_features)
    expert_layers: frozenset[int] = frozenset()  # mixture-of-experts layers whose routed experts are served
    num_experts: int = 0
    expert_shapes: dict[str, tuple[int, int]] | None = None  # experts' parameter -> one expert's (in, out)

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
        whole = [i for i, layer in enumerate(layers) if type(getattr(layer.mlp, "experts", None)) is Experts]
        if not whole:
            return cls(len(layers), dense, shapes)
        num_experts, two_inter, _ = layers[whole[0]].mlp.experts.gate_up_proj.shape
        expert_shapes = {"gate_up_proj": (hidden, two_inter), "down_proj": (two_inter // 2, hidden)}
        return cls(len(layers), dense, shapes, frozenset(whole), num_experts, expert_shapes)

    def module_name(self, path: str, layer: int, inner: str) -> str:
        """``layers.<layer>.<inner>`` when served; ValueError naming it otherwise."""
        name = f"layers.{layer}.{inner}"
        if layer >= self.num_layers:
            raise ValueError(f"LoRA adapter {path!r}: {name}: the model has {self.num_layers} layers")
        block, _, proj = inner.partition(".")
        if block == "self_attn" and proj in ATTENTION_MODULES:
            return name
        if block == "mlp" and (proj in MLP_MODULES or proj in CHECKPOINT_FUSED) and layer in self.dense_layers:
            return name
        if block == "mlp" and layer not in self.dense_layers:
            raise ValueError(f"LoRA adapter {path!r}: {name} is a mixture-of-experts module: LoRA on per-expert "
                             "modules, shared experts or the router is not served (the routed experts are served "
                             "as PEFT's target_parameters mlp.experts.gate_up_proj / down_proj)")
        raise ValueError(f"LoRA adapter {path!r}: target {name} is not served "
                         f"(served: {', '.join(PEFT_MODULES)})")

    def expert_module(self, path: str, layer: int, parameter: str) -> str:
        """``layers.<layer>.mlp.experts.<parameter>`` when this layer's routed experts are served; ValueError
        naming why not otherwise."""
        name = f"layers.{layer}.mlp.experts.{parameter}"
        if layer not in self.expert_layers:
            why = "not a mixture-of-experts layer" if layer in self.dense_layers or layer >= self.num_layers else \
                "its experts are tensor-parallel, expert-parallel or quantized here (LoRA on experts is served " \
                "on whole, unquantized experts only)"
            raise ValueError(f"LoRA adapter {path!r}: {name} is not served: {why}")
        return name

    def shape(self, module: str) -> tuple[int, int]:
        proj = module.rsplit(".", 1)[1]
        if proj in CHECKPOINT_FUSED:  # the stacked rows of its parts
            parts = [self.shapes[part] for part in CHECKPOINT_FUSED[proj]]
            return parts[0][0], sum(out for _, out in parts)
        return self.shapes[proj]
