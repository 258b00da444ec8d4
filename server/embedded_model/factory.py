"""Offline factory for tiny Hugging Face models: the embedded default model, tests and benchmarks.

Everything is built locally and deterministically (no downloads): the tokenizer of
``server/embedded_model/tokenizer.py`` and a randomly initialised model of one of ``ARCHS`` saved as
a regular Hugging Face directory (config.json, generation_config.json, model.safetensors, tokenizer
files). Same arguments -> byte-identical files, so tests can compare runs and caches can be trusted.
"""

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GenerationConfig,
    Glm4Config,
    Glm4ForCausalLM,
    Glm4MoeConfig,
    Glm4MoeForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from xinserve.server.embedded_model.build_once import ensure_built
from xinserve.server.embedded_model.tokenizer import make_tokenizer
from xinserve.server.embedded_model.weights import LM_HEAD_GAIN, config_kwargs, initial_value

_MLA = {
    "num_key_value_heads": 4, "head_dim": 8, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
    "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
}
# 16 indexer heads: a position scores exactly 0 (a tie whose order transformers itself breaks differently
# in its cached and uncached paths) only when all 16 relu to 0, which these tests never meet.
_DSA = {"index_topk": 12, "index_head_dim": 16, "index_n_heads": 16}
# arch -> (config class, model class, arch-specific config defaults).
ARCHS: dict[str, tuple[type[PretrainedConfig], type[PreTrainedModel], dict]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    # No sliding window (the default 4096 is inert at our lengths anyway); override to test one.
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v biases are built into Qwen2
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),  # per-head q/k RMSNorm is built into Qwen3
    "glm4": (Glm4Config, Glm4ForCausalLM, {"partial_rotary_factor": 0.5, "attention_bias": True}),
    # Mixture-of-experts, small and odd on purpose: 8 experts top-2 with a dense first layer;
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True,
        "mlp_only_layers": [0]}),
    # 6 experts top-2 on every layer;
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 6, "num_experts_per_tok": 2}),
    # 8 experts in 2 groups (top-2 from the best group), a shared expert, a dense first layer, scaled
    # weights, q/k norm and partial rotary.
    "glm4_moe": (Glm4MoeConfig, Glm4MoeForCausalLM, {
        "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_group": 2,
        "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "use_qk_norm": True, "attention_bias": True, "partial_rotary_factor": 0.5}),
    # Multi-head latent attention with GLM-4.5's kind of experts (3 layers: the first dense). One
    # latent head: num_key_value_heads equals the query heads, as transformers' MLA expects.
    # head_dim is the rotary width (qk_rope_head_dim), which transformers rotates by.
    "deepseek_v3": (DeepseekV3Config, DeepseekV3ForCausalLM, {**_MLA, "num_hidden_layers": 3}),
    # ... plus the DSA indexer, which keeps index_topk = 12 positions: shorter than most test prompts
    "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM, {**_MLA, **_DSA, "num_hidden_layers": 3}),
    "glm_moe_dsa": (GlmMoeDsaConfig, GlmMoeDsaForCausalLM, {**_MLA, **_DSA, "num_hidden_layers": 3}),
}


ARCHS_BY_CONFIG = {config_cls: model_cls for config_cls, model_cls, _ in ARCHS.values()}


def make_config(arch: str, **kwargs) -> PretrainedConfig:
    """A Hugging Face config for one of ``ARCHS``; ``kwargs``: ``weights.config_kwargs``'s (vocab_size,
    hidden_size, num_layers, ..., then any config key as an override)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(ARCHS)}")
    config_cls, model_cls, arch_defaults = ARCHS[arch]
    config = config_cls(**config_kwargs(arch_defaults, **kwargs))
    config.architectures = [model_cls.__name__]
    return config


def _randomize(model: torch.nn.Module, std: float, seed: int) -> None:
    """Deterministic weights, including non-default norm weights and biases.

    Hugging Face initialises norms to 1 and biases to 0; random values here make an engine that
    forgets a bias or a norm weight produce different tokens, so the tests can catch it.
    Parameters are drawn in name order from one generator, independent of HF's init order, then the
    learned buffers (GLM-4.5's router bias, zero at init), so that the choice of experts depends on it.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            param.copy_(initial_value(name, param.shape, gen, std))
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # of the order of the sigmoid scores' spread
                buffer.copy_(0.1 * torch.randn(buffer.shape, generator=gen, dtype=torch.float32))


def make_tiny_model(
    path: str | Path,
    arch: str = "llama",
    *,
    vocab_size: int | None = None,
    max_position_embeddings: int = 2048,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    mtp: bool = False,
    mtp_own_head: bool = False,
    **config_kwargs,
) -> Path:
    """Build a random tiny model plus tokenizer into ``path`` (created if needed); returns ``path``.

    ``config_kwargs``: ``make_config``'s (hidden_size, num_layers, num_heads, ..., overrides).
    ``vocab_size`` defaults to the tokenizer's size; a larger one adds embedding rows that the
    tokenizer never produces (as real checkpoints pad their vocabularies).
    ``mtp`` (the MTP archs: deepseek_v3, deepseek_v32, glm4_moe, glm_moe_dsa): also write a random
    multi-token-prediction layer at ``model.layers.<num_layers>.*`` (``_add_mtp_layer``), sharing the
    target's embedding and head unless ``mtp_own_head``.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(path, model_max_length=max_position_embeddings)
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)}")
    if mtp:
        config_kwargs["num_nextn_predict_layers"] = 1
    config = make_config(
        arch, vocab_size=vocab_size or len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        max_position_embeddings=max_position_embeddings, dtype=dtype, **config_kwargs,
    )
    with torch.random.fork_rng(devices=[]):  # HF's own init draws from the global RNG: hide that
        model = ARCHS[arch][1](config)
    _randomize(model, config.initializer_range, seed)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    model.save_pretrained(str(path))
    if mtp:
        _add_mtp_layer(path, config, dtype, seed, mtp_own_head)
    return path


def _add_mtp_layer(path: Path, config: PretrainedConfig, dtype: torch.dtype, seed: int, own_head: bool) -> None:
    """Append a random MTP layer to ``path/model.safetensors``, named as DeepSeek-V3's and GLM's
    checkpoints name it: ``model.layers.<N>.`` + the decoder layer of a model one layer deeper (MoE or
    dense as that architecture's rule says for layer N), ``enorm``, ``hnorm``, ``eh_proj``,
    ``shared_head.norm`` and, with ``own_head``, ``shared_head.head`` and ``embed_tokens``."""
    n = config.num_hidden_layers
    # per-layer lists are rebuilt for n + 1 layers by the config class itself
    values = {key: None if key.endswith("layer_types") or key == "indexer_types" else value
              for key, value in config.to_dict().items()}
    deeper = type(config)(**{**values, "num_hidden_layers": n + 1})
    with torch.random.fork_rng(devices=[]):
        model = ARCHS_BY_CONFIG[type(config)](deeper)
    _randomize(model, config.initializer_range, seed + 1)
    prefix = f"model.layers.{n}."
    extra = _per_expert({key: value for key, value in model.state_dict().items() if key.startswith(prefix)})
    hidden, std = config.hidden_size, config.initializer_range
    gen = torch.Generator().manual_seed(seed + 2)
    extra[prefix + "enorm.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=gen)
    extra[prefix + "hnorm.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=gen)
    extra[prefix + "shared_head.norm.weight"] = 1.0 + 0.2 * torch.randn(hidden, generator=gen)
    extra[prefix + "eh_proj.weight"] = std * torch.randn(hidden, 2 * hidden, generator=gen)
    if own_head:
        extra[prefix + "shared_head.head.weight"] = LM_HEAD_GAIN * std * torch.randn(config.vocab_size, hidden,
                                                                                     generator=gen)
        extra[prefix + "embed_tokens.weight"] = std * torch.randn(config.vocab_size, hidden, generator=gen)
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors.update({key: value.to(dtype).contiguous() for key, value in extra.items()})
    save_file(tensors, str(file), metadata={"format": "pt"})


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked routed experts (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I])
    as the published checkpoints store them: one ``mlp.experts.<e>.{gate,up,down}_proj.weight`` each."""
    out = {}
    for key, value in tensors.items():
        stem, _, leaf = key.rpartition(".")
        if not stem.endswith("mlp.experts") or leaf not in ("gate_up_proj", "down_proj"):
            out[key] = value
            continue
        for e, weight in enumerate(value):
            parts = zip(("gate_proj", "up_proj"), weight.chunk(2)) if leaf == "gate_up_proj" else [(leaf, weight)]
            out.update({f"{stem}.{e}.{name}.weight": part.clone() for name, part in parts})
    return out


def ensure_tiny_model(cache_dir: str | Path, name: str = "xinserve-tiny", **kwargs) -> Path:
    """``cache_dir/name``, built with ``make_tiny_model(**kwargs)`` on first use and reused after
    (``build_once.ensure_built``: a later call with other ``kwargs`` gets the cached one)."""
    return ensure_built(cache_dir, name, lambda path: make_tiny_model(path, **kwargs))
