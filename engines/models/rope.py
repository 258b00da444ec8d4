"""Rotary tables built once per model from a Hugging Face config.

Reads both the transformers-5 ``config.rope_parameters`` dict and the older ``config.rope_theta`` /
``config.rope_scaling`` / ``config.partial_rotary_factor`` attributes.
"""

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_settings(config: Any) -> dict[str, Any]:
    """One flat dict of the rope settings: the old attributes first, the newer dict over them."""
    settings: dict[str, Any] = {}
    for key in ("rope_theta", "partial_rotary_factor"):
        if getattr(config, key, None) is not None:
            settings[key] = getattr(config, key)
    settings.update(getattr(config, "rope_scaling", None) or {})
    settings.update(getattr(config, "rope_parameters", None) or {})
    return settings


def rotary_dim(config: Any, head_dim: int) -> int:
    """How many leading dims of each head are rotated (partial rotary, e.g. GLM-4's 0.5)."""
    return int(head_dim * rope_settings(config).get("partial_rotary_factor", 1.0))


def build_cos_sin_cache(rotary_dim: int, max_positions: int, config: Any) -> torch.Tensor:
    """[max_positions, rotary_dim] float32: cos of the rotary_dim / 2 frequencies, then their sin."""
    settings = rope_settings(config)
    rope_type = settings.get("rope_type", settings.get("type", "default"))
    base = float(settings.get("rope_theta", 10000.0))
    # inv_freq: [rotary_dim / 2]
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(settings["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, settings, config)
    elif rope_type != "default":
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    # angles: [max_positions, rotary_dim / 2]
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def _llama3_inv_freq(inv_freq: torch.Tensor, settings: dict[str, Any], config: Any) -> torch.Tensor:
    """Llama 3.1 scaling: long wavelengths are slowed by ``factor``, short ones kept, and the band
    in between interpolated smoothly."""
    factor = float(settings["factor"])
    low_freq_factor = float(settings["low_freq_factor"])
    high_freq_factor = float(settings["high_freq_factor"])
    old_context = float(settings.get("original_max_position_embeddings", config.max_position_embeddings))
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low_freq_factor, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_context / high_freq_factor) & (wavelen <= old_context / low_freq_factor)
    return torch.where(is_medium, smoothed, scaled)
