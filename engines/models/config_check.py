"""Refuse a checkpoint whose config asks for math these models do not implement.

A server must compute a model exactly or not serve it: a config field that changes the math and is
silently ignored gives plausible, wrong text. Each entry below is a field that transformers honours
for some architecture (or that marks a checkpoint format) and that no model here implements; the
loader calls ``unsupported_config_fields`` before building anything and names every problem.
What is implemented: SiLU-gated MLPs, "default" / "linear" / "llama3" / "yarn" rotary (full or
partial, rotate-half or interleaved), full and sliding-window attention ("full_attention" /
"sliding_attention" layers), multi-head latent attention with the DSA indexer ("indexed_attention"
layers of DeepSeek-V3.2 / GLM-5), q/k norm, attention and MLP biases, and the MoE routing of
Qwen3-MoE, Mixtral, GLM-4.5 and DeepSeek-V3. A ``quantization_config`` is the quantization
formats' to judge (engines/quantization/formats/): one no format implements is refused there.
"""

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from xinserve.engines.models.rope import SUPPORTED_ROPE_TYPES, rope_settings

SUPPORTED_ACTIVATIONS = ("silu",)
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention", "indexed_attention")  # the last: DSA
# field -> what it would change; refused whenever set (not None, not False)
UNIMPLEMENTED_FIELDS = {
    "attn_logit_softcapping": "tanh soft-capping of the attention logits",
    "final_logit_softcapping": "tanh soft-capping of the output logits",
    "query_pre_attn_scalar": "an attention scale other than head_dim ** -0.5",
    "logits_scaling": "a divisor on the output logits",
    "embedding_multiplier": "a multiplier on the input embeddings",
    "residual_multiplier": "a multiplier on the residual branches",
    "attention_multiplier": "an attention scale other than head_dim ** -0.5",
}

# The sizes every model here is built from; head_dim is often absent (hidden_size / heads).
SIZE_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
               "vocab_size", "max_position_embeddings")


def invalid_sizes(fields: Mapping[str, Any]) -> list[str]:
    """One message per size field that is set and is not a positive integer, naming the field."""
    return [f"{field} must be a positive integer, got {value!r}" for field in SIZE_FIELDS
            if (value := fields.get(field)) is not None
            and (isinstance(value, bool) or not isinstance(value, int) or value < 1)]


def read_model_config(path: str) -> PretrainedConfig:
    """transformers' config of the model directory ``path``; ValueError naming config.json (and the
    field, where we check it) when the file is missing, is not JSON, or cannot make a model."""
    config_file = Path(path) / "config.json"
    try:
        fields = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # missing, unreadable, not UTF-8, not JSON
        raise ValueError(f"cannot read {config_file}: {exc}") from None
    problems = invalid_sizes(fields) if isinstance(fields, dict) else ["the top level must be a JSON object"]
    if problems:
        raise ValueError(f"{config_file}: {'; '.join(problems)}")
    try:
        return AutoConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001  transformers checks the other fields in many ways (strict dataclasses)
        message = str(exc).strip().splitlines() or [type(exc).__name__]
        raise ValueError(f"{config_file}: {message[-1].strip()}") from None


def unsupported_config_fields(config: Any) -> list[str]:
    """One message per config field that asks for unimplemented math, naming the field; [] when
    the config is fully supported."""
    problems = []
    activation = getattr(config, "hidden_act", "silu")
    if activation not in SUPPORTED_ACTIVATIONS:
        problems.append(f"hidden_act={activation!r} (implemented: {', '.join(SUPPORTED_ACTIVATIONS)})")
    rope = rope_settings(config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        problems.append(f"rope_parameters.rope_type={rope_type!r} (implemented: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope.get("mrope_section"):
        problems.append("rope_parameters.mrope_section (multimodal rotary)")
    layer_types = set(getattr(config, "layer_types", None) or ()) - set(SUPPORTED_LAYER_TYPES)
    if layer_types:
        problems.append(f"layer_types={sorted(layer_types)} (implemented: {', '.join(SUPPORTED_LAYER_TYPES)})")
    for field, meaning in UNIMPLEMENTED_FIELDS.items():
        value = getattr(config, field, None)
        if value is not None and value is not False:
            shown = field if isinstance(value, dict) else f"{field}={value!r}"
            problems.append(f"{shown} ({meaning})")
    return problems
