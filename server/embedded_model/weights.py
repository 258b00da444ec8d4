"""What every tiny model shares, whichever way it is written (``factory.py`` through transformers' model
classes, ``llama_files.py`` directly): the config's base keys and the deterministic initial values.
Imports torch only, so the embedded model can be built without loading any transformers model class."""

import torch

# A larger output projection makes the logits peaked (median top-1/top-2 gap ~0.8), so greedy
# argmax survives float noise between kernels, while the inner weights stay small enough that the
# attention softmax is not saturated (a saturated one would hide attention bugs).
LM_HEAD_GAIN = 2.5


def config_kwargs(
    arch_defaults: dict | None = None,
    *,
    vocab_size: int,
    bos_token_id: int,
    eos_token_id: int,
    pad_token_id: int,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.float32,
    **overrides,
) -> dict:
    """A Hugging Face config's keyword arguments: the keys every architecture gets, then the
    architecture's ``arch_defaults``, then ``overrides`` (any config key), each winning over the last."""
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError("hidden_size must divide by num_heads, and num_heads by num_kv_heads")
    return {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 3 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        # Explicit everywhere: Qwen3 and GLM-4 default head_dim to 128, not hidden / heads.
        "head_dim": hidden_size // num_heads,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        # Ten times HF's usual 0.02: the random model then gives varied, decisive greedy output.
        "initializer_range": 0.2,
        "tie_word_embeddings": tie_word_embeddings,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "dtype": dtype,
        **(arch_defaults or {}),
        **overrides,
    }


def initial_value(name: str, shape: torch.Size | tuple[int, ...], gen: torch.Generator, std: float) -> torch.Tensor:
    """Parameter ``name``'s float32 value, drawn next from ``gen``: norms around 1 (not HF's exact 1, so
    an engine that forgets a norm weight produces other tokens), the output head ``LM_HEAD_GAIN``
    times wider than the other weights (absent when tied: a scaled input embedding would dominate
    the residual stream and make the output repetitive)."""
    noise = torch.randn(shape, generator=gen, dtype=torch.float32)
    if "norm" in name:
        return 1.0 + 0.2 * noise
    if name.startswith("lm_head"):
        return LM_HEAD_GAIN * std * noise
    return std * noise
