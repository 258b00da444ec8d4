"""A PEFT adapter's LoRA on the routed experts, as PEFT (0.21, transformers 5) writes it: ``target_parameters``
on the experts' stacked ``gate_up_proj`` [E, 2I, Hd] and ``down_proj`` [E, Hd, I] (PEFT's ``ParamWrapper``;
``target_modules`` naming gate/up/down_proj on a MoE model is converted to these by PEFT, its gate_up rank
doubled in ``rank_pattern``).

Saved keys: each targeted parameter wraps the ``experts`` module once more, in the order the module holds
its parameters (gate_up_proj, then down_proj), so with both targeted ``mlp.experts.base_layer.lora_A.weight``
is gate_up_proj's and ``mlp.experts.lora_A.weight`` down_proj's. One parameter of rank r holds every
expert's factors: lora_A [E * r, in] (expert e's A in rows [e * r, (e + 1) * r)) and lora_B [out, r * E]
(expert e's B in columns e, e + E, ...); PEFT's delta of expert e is scaling * B_e @ A_e.
"""

import re

import torch

from xinserve.engines.lora.expert_stacks import EXPERT_PARAMETERS

# "mlp.experts" wrapped n times over: (.base_layer) * n
WRAPPED = re.compile(r"mlp\.experts((?:\.base_layer)*)")


def expert_parameters(path: str, config: dict) -> list[str]:
    """The experts' parameters ``target_parameters`` names, in PEFT's nesting order (innermost first);
    ValueError naming any other parameter."""
    named = config.get("target_parameters") or []
    leaves = set()
    for name in named:
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in EXPERT_PARAMETERS or not re.fullmatch(r"((.*\.)?experts\.)?\w+", name):
            raise ValueError(f"LoRA adapter {path!r}: target_parameters {name!r} is not served (served: the "
                             f"routed experts' {', '.join(EXPERT_PARAMETERS)})")
        leaves.add(leaf)
    return [leaf for leaf in EXPERT_PARAMETERS if leaf in leaves]


def expert_parameter(path: str, layer: int, inner: str, targeted: list[str]) -> str | None:
    """The parameter a key's ``inner`` (``mlp.experts(.base_layer)*``) holds, from its nesting depth; None
    when ``inner`` is not the experts' wrapper."""
    match = WRAPPED.fullmatch(inner)
    if match is None:
        return None
    depth = match[1].count(".base_layer")
    if depth >= len(targeted):
        raise ValueError(f"LoRA adapter {path!r}: layers.{layer}.{inner} does not fit its target_parameters "
                         f"{targeted}")
    return targeted[len(targeted) - 1 - depth]


def split_experts(path: str, module: str, a: torch.Tensor, b: torch.Tensor, r: int, num_experts: int,
                  in_features: int, out_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's lora_A [E * r, in] and lora_B [out, r * E] (``r`` from the adapter's config: the shapes alone
    cannot tell E from r) -> per expert (A [E, r, in], B [E, out, r])."""
    if a.shape != (num_experts * r, in_features) or b.shape != (out_features, num_experts * r):
        raise ValueError(f"LoRA adapter {path!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                         f"this model's {num_experts} experts at rank {r} need ({num_experts * r}, {in_features}) "
                         f"and ({out_features}, {num_experts * r}): was it trained on another base model?")
    return a.reshape(num_experts, r, in_features), b.reshape(out_features, r, num_experts).permute(2, 0, 1)
