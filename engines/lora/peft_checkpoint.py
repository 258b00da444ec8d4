"""A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) read into host
tensors, each module's scaling folded into its B, or refused by name with a ValueError.

What is served: LoRA (not DoRA) on q/k/v/o_proj of the attention and gate/up/down_proj of dense MLP
layers (GLM-4's fused gate_up_proj too), ``target_parameters`` on the routed experts' gate_up_proj and
down_proj (engines/lora/expert_checkpoint.py), rank at most ``max_lora_rank`` (each module's rank is its
lora_A's rows, per expert for the experts, so PEFT's ``rank_pattern`` is honoured as written),
``lora_alpha`` with ``alpha_pattern``, rsLoRA. Refused: targets other than those (lm_head, embed_tokens,
per-expert modules, shared experts, the router), trained biases, ``modules_to_save``, ``use_dora``,
trainable tokens, layer replication.
"""

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from xinserve.engines.lora.expert_checkpoint import expert_parameter, expert_parameters, split_experts
from xinserve.engines.lora.targets import CHECKPOINT_FUSED, PEFT_MODULES, ModelTargets

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight (PEFT's saved names)
KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(.+)\.lora_([AB])\.weight")
# adapter_config.json settings whose non-default value changes the math we would serve
UNSERVED_SETTINGS = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save",
    "lora_bias": "LoRA biases (lora_bias)",
    "trainable_token_indices": "trainable tokens (trainable_token_indices)",
    "layer_replication": "layer_replication",
    "fan_in_fan_out": "fan_in_fan_out",
    "use_qalora": "QA-LoRA (use_qalora)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
}


@dataclass(slots=True)
class AdapterWeights:
    """One adapter on the host: per module ("layers.<i>.<proj>", PEFT's projection name) A [r, in] and
    B [out, r] with the scaling folded in, both float32, full (unsharded) shapes; per routed experts'
    parameter ("layers.<i>.mlp.experts.<gate_up_proj|down_proj>") A [E, r, in] and B [E, out, r]."""

    path: str
    rank: int  # the largest module rank
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.modules.values())


def read_adapter(path: str, targets: ModelTargets, max_lora_rank: int) -> AdapterWeights:
    """Read and check the PEFT adapter at ``path`` against the model's ``targets``; ValueError naming
    what cannot be served."""
    directory = Path(path)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise ValueError(f"LoRA adapter {path!r}: {needed.name} not found (a PEFT LoRA directory holds "
                             f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter {path!r}: {CONFIG_FILE} is not readable JSON ({exc})") from None
    _check_config(path, config)
    try:
        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001  safetensors raises its own error types for a bad file
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} cannot be read ({exc})") from None
    pairs = _pairs(path, tensors, targets, expert_parameters(path, config))
    adapter = AdapterWeights(str(directory), rank=0)
    for module, (a, b) in sorted(pairs.items()):
        expert = ".experts." in module  # the routed experts: every expert's factors in one pair
        if expert:
            a, b = split_experts(path, module, a, b, _rank(config, module), targets.num_experts,
                                 *targets.expert_shapes[module.rsplit(".", 1)[1]])
        r = a.shape[-2]
        if r > max_lora_rank:
            raise ValueError(f"LoRA adapter {path!r}: {module} has rank {r}, more than max_lora_rank "
                             f"{max_lora_rank} (raise --max-lora-rank)")
        scale = _alpha(config, module) / (math.sqrt(r) if config.get("use_rslora") else r)
        adapter.rank = max(adapter.rank, r)
        if expert:
            adapter.modules[module] = (a.float().contiguous(), (b.float() * scale).contiguous())
            continue
        in_features, out_features = targets.shape(module)
        if a.shape != (r, in_features) or b.shape != (out_features, r):
            raise ValueError(f"LoRA adapter {path!r}: {module} has lora_A {tuple(a.shape)} and lora_B "
                             f"{tuple(b.shape)}, this model needs ({r}, {in_features}) and ({out_features}, {r}): "
                             "was it trained on another base model?")
        a, b = a.float().contiguous(), b.float() * scale
        prefix, proj = module.rsplit(".", 1)
        parts = CHECKPOINT_FUSED.get(proj, (proj,))
        # a fused checkpoint projection: each part its rows of B and the whole (shared) A
        for part, rows in zip(parts, b.split([targets.shapes[p][1] for p in parts])):
            adapter.modules[f"{prefix}.{part}"] = (a, rows.contiguous())
    if not adapter.modules:
        raise ValueError(f"LoRA adapter {path!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return adapter


def _check_config(path: str, config: dict) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {config.get('peft_type')!r} is not served (LORA only)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: trained biases (bias {config['bias']!r}) are not served")
    for key, what in UNSERVED_SETTINGS.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {what} is not served")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) and re.fullmatch(r"\w+", targets) else targets
    if isinstance(names, list):
        unknown = sorted(set(names) - set(PEFT_MODULES) - set(CHECKPOINT_FUSED))
        if unknown:
            raise ValueError(f"LoRA adapter {path!r}: target module(s) {', '.join(unknown)} are not served "
                             f"(served: {', '.join(PEFT_MODULES)})")


def _pairs(path: str, tensors: dict[str, torch.Tensor], targets: ModelTargets, experts: list[str]
           ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (lora_A, lora_B), every saved tensor accounted for; ``experts``: the experts' parameters
    the adapter targets, innermost first."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"LoRA adapter {path!r}: weight {key!r} is not served (LoRA A/B of "
                             f"{', '.join(PEFT_MODULES)} in the decoder layers only)")
        layer, inner, half = int(match[1]), match[2], match[3]
        parameter = expert_parameter(path, layer, inner, experts)
        module = targets.module_name(path, layer, inner) if parameter is None else \
            targets.expert_module(path, layer, parameter)
        halves.setdefault(module, {})[half] = tensor
    pairs = {}
    for module, found in halves.items():
        if set(found) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} has lora_{''.join(found)} but not its pair")
        pairs[module] = (found["A"], found["B"])
    return pairs


def _alpha(config: dict, module: str) -> float:
    """``alpha_pattern``'s value for ``module``, else ``lora_alpha``."""
    return float(_pattern_value(config, "alpha_pattern", module, config.get("lora_alpha", 8)))


def _rank(config: dict, module: str) -> int:
    """``rank_pattern``'s value for ``module``, else ``r``: the experts' factors hold E * r rows, so their
    rank is read from the config, not the shapes."""
    return int(_pattern_value(config, "rank_pattern", module, config.get("r", 8)))


def _pattern_value(config: dict, patterns: str, module: str, default: float) -> float:
    """The value of the first key of ``config[patterns]`` that matches ``module`` (PEFT matches a key
    against the end of the module's name), else ``default``."""
    name = f"model.{module}"
    for pattern, value in (config.get(patterns) or {}).items():
        if re.fullmatch(rf"(.*\.)?{pattern}", name):
            return value
    return default
