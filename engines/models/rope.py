"""Rotary tables built once per model from a Hugging Face config.

Reads both the transformers-5 ``config.rope_parameters`` dict and the older ``config.rope_theta`` /
``config.rope_scaling`` / ``config.partial_rotary_factor`` attributes.
"""

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    """[max_positions, rotary_dim] float32: cos of the rotary_dim / 2 frequencies, then their sin
    (both times YaRN's attention factor when the config asks for YaRN, as transformers scales them)."""
    settings = rope_settings(config)
    rope_type = settings.get("rope_type", settings.get("type", "default"))
    base = float(settings.get("rope_theta", 10000.0))
    # inv_freq: [rotary_dim / 2]
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if rope_type == "linear":
        inv_freq = inv_freq / float(settings["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, settings, config)
    elif rope_type == "yarn":
        inv_freq, attention_factor = _yarn_inv_freq(rotary_dim, base, settings, config)
    elif rope_type != "default":
        raise ValueError(
            f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    # angles: [max_positions, rotary_dim / 2]
    angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    table = torch.cat((angles.cos(), angles.sin()), dim=-1)
    return table * attention_factor if rope_type == "yarn" else table


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


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched ``factor`` times (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(
    rotary_dim: int, base: float, settings: dict[str, Any], config: Any
) -> tuple[torch.Tensor, float]:
    """YaRN (DeepSeek-V3's long context): high frequencies kept, low ones slowed by ``factor``, a
    linear ramp between the dims that turn ``beta_fast`` and ``beta_slow`` times over the original
    context; plus the factor cos and sin are scaled by (``attention_factor``, else from ``mscale``
    and ``mscale_all_dim``). Returns (inv_freq [rotary_dim / 2], attention factor)."""
    old_context = float(settings["original_max_position_embeddings"])
    factor = settings.get("factor") or config.max_position_embeddings / old_context
    attention_factor = settings.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = settings.get("mscale"), settings.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = settings.get("beta_fast") or 32, settings.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return rotary_dim * math.log(old_context / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if settings.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolated = 1 - ramp  # share of the original frequency kept per dim
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
    return inv_freq, float(attention_factor)
