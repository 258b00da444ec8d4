"""Rotary tables from old- and new-style configs."""

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from xinserve.engines.models.rope import build_cos_sin_cache, rotary_dim


def expected_cache(inv_freq: list[float], max_positions: int) -> torch.Tensor:
    rows = []
    for p in range(max_positions):
        rows.append([math.cos(p * f) for f in inv_freq] + [math.sin(p * f) for f in inv_freq])
    return torch.tensor(rows)


def test_old_style_attributes_with_linear_scaling() -> None:
    config = SimpleNamespace(rope_theta=100.0, rope_scaling={"type": "linear", "factor": 2.0},
                             max_position_embeddings=16)
    inv_freq = [100.0 ** (-i / 4) / 2.0 for i in (0, 2)]
    torch.testing.assert_close(build_cos_sin_cache(4, 16, config), expected_cache(inv_freq, 16))


def test_new_style_default_with_partial_rotary() -> None:
    config = SimpleNamespace(rope_parameters={"rope_type": "default", "rope_theta": 10.0,
                                              "partial_rotary_factor": 0.5}, max_position_embeddings=8)
    assert rotary_dim(config, 16) == 8
    inv_freq = [10.0 ** (-i / 8) for i in (0, 2, 4, 6)]
    cache = build_cos_sin_cache(rotary_dim(config, 16), 8, config)
    assert cache.shape == (8, 8)
    torch.testing.assert_close(cache, expected_cache(inv_freq, 8))


def test_old_style_partial_rotary_attribute() -> None:
    assert rotary_dim(SimpleNamespace(partial_rotary_factor=0.25, rope_theta=1e4), 32) == 8
    assert rotary_dim(SimpleNamespace(rope_theta=1e4), 32) == 32


def test_llama3_matches_transformers() -> None:
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512,
                         rope_parameters=rope)
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config)
    ours = build_cos_sin_cache(64, 512, config)
    plain = build_cos_sin_cache(64, 512, LlamaConfig(hidden_size=256, num_attention_heads=4,
                                                     rope_parameters={"rope_type": "default",
                                                                      "rope_theta": 500000.0}))
    angles = torch.arange(512).float()[:, None] * hf_inv_freq[None, :]
    torch.testing.assert_close(ours, torch.cat((angles.cos(), angles.sin()), dim=-1), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours, plain)  # the scaling changed some frequencies


@pytest.mark.parametrize("mscales", [{}, {"mscale": 0.707, "mscale_all_dim": 1.0}, {"attention_factor": 1.3}])
def test_yarn_matches_transformers_with_its_attention_factor(mscales) -> None:
    """DeepSeek-V3's YaRN: transformers' frequencies, and cos / sin times its attention factor
    (from factor alone, from mscale / mscale_all_dim, or given)."""
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
            "original_max_position_embeddings": 64, **mscales}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, max_position_embeddings=512,
                         rope_parameters=rope)
    hf_inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert attention_factor != 1.0
    angles = torch.arange(512).float()[:, None] * hf_inv_freq[None, :]
    expected = torch.cat((angles.cos(), angles.sin()), dim=-1) * attention_factor
    torch.testing.assert_close(build_cos_sin_cache(64, 512, config), expected, atol=1e-5, rtol=1e-5)


def test_unknown_rope_type_names_the_supported_ones() -> None:
    config = SimpleNamespace(rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match="longrope.*default, linear, llama3, yarn"):
        build_cos_sin_cache(8, 8, config)
