"""The decoder-only causal LM every supported architecture is built from.

An architecture differs only in a ``DecoderSpec`` (biases, q/k norm, rotary style, extra norms);
each model file subclasses ``CausalLM`` and overrides ``spec``. Parameter names mirror the Hugging
Face checkpoints except for the fused ``qkv_proj`` and ``gate_up_proj``.
"""

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engines.attention_metadata import AttentionMetadata
from engines.models.layers import Attention, GatedMLP, MergedLinear, RMSNorm
from engines.models.rope import build_cos_sin_cache, rotary_dim
from kernels.ops import REFERENCE_OPS, KernelOps
from kernels.probes import ModelShapes

# checkpoint projection -> (our fused projection, shard index in its output_sizes)
FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# checkpoint entries that are derived, not learned
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


@dataclass(slots=True)
class DecoderSpec:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before rotary
    rope_is_neox: bool = True  # False: interleaved pairs (GLM-4)
    sandwich_norm: bool = False  # GLM-4: extra norms on the attention and MLP outputs


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec, head_dim: int, ops: KernelOps) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(
            hidden, config.num_attention_heads, config.num_key_value_heads, head_dim,
            qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, qk_norm_eps=eps if spec.qk_norm else None,
            rope_is_neox=spec.rope_is_neox, ops=ops,
        )
        self.mlp = GatedMLP(hidden, config.intermediate_size, bias=spec.mlp_bias, ops=ops)
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.post_self_attn_layernorm = RMSNorm(hidden, eps, ops) if spec.sandwich_norm else None
        self.post_mlp_layernorm = RMSNorm(hidden, eps, ops) if spec.sandwich_norm else None

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: AttentionMetadata,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately and added inside the next norm (fused add).
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, key_cache, value_cache, metadata, cos_sin)
        if self.post_self_attn_layernorm is not None:
            hidden = self.post_self_attn_layernorm(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.post_mlp_layernorm is not None:
            hidden = self.post_mlp_layernorm(hidden)
        return hidden, residual


class DecoderModel(nn.Module):
    def __init__(self, config: Any, spec: DecoderSpec, head_dim: int, ops: KernelOps) -> None:
        super().__init__()
        self.rope_is_neox = spec.rope_is_neox
        self.rotary_cos_sin = ops.rotary_cos_sin
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, head_dim, ops) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None  # hidden: [T, hidden]
        # Everything that depends only on the step is built here once, not in every layer: the
        # rotation of each position and the per-layer cache views (kv_cache[0][i]: [N, BS, KVH, D]).
        cos_sin = self.rotary_cos_sin(positions, cos_sin_cache, self.rope_is_neox, hidden.dtype)
        for layer, key_cache, value_cache in zip(self.layers, kv_cache[0].unbind(0), kv_cache[1].unbind(0)):
            hidden, residual = layer(hidden, residual, key_cache, value_cache, metadata, cos_sin)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class CausalLM(nn.Module):
    """Llama-shaped causal LM. Subclasses choose the architecture's ``spec``; ``ops`` are the
    kernels it calls (the registry's choice for the device)."""

    def __init__(self, config: Any, ops: KernelOps = REFERENCE_OPS) -> None:
        super().__init__()
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"only the silu activation is supported, got {config.hidden_act!r}")
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.config_head_dim(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = DecoderModel(config, self.spec(config), self.head_dim, ops)
        # Tied: the logits reuse the embedding matrix, there is no separate lm_head.
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )
        self.register_buffer("cos_sin_cache", self._build_rope_cache(), persistent=False)

    @staticmethod
    def config_head_dim(config: Any) -> int:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    @classmethod
    def kernel_shapes(cls, config: Any, block_size: int = 16) -> ModelShapes:
        """What this model's kernels will see, for the kernel registry's probes."""
        head_dim = cls.config_head_dim(config)
        return ModelShapes(
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim(config, head_dim),
            rope_is_neox=cls.spec(config).rope_is_neox,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            block_size=block_size,
            rms_norm_eps=config.rms_norm_eps,
        )

    @staticmethod
    def spec(config: Any) -> DecoderSpec:
        return DecoderSpec(
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    def _build_rope_cache(self) -> torch.Tensor:
        dim = rotary_dim(self.config, self.head_dim)
        return build_cos_sin_cache(dim, self.config.max_position_embeddings, self.config)

    def reset_buffers(self) -> None:
        """Recompute the derived buffers on the model's device and dtype (the loader calls this
        after materialising a model built on the meta device)."""
        self.cos_sin_cache = self._build_rope_cache().to(self.cos_sin_cache.device, self.cos_sin_cache.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_cache: [2, L, N, BS, KVH, D]. Returns [T, hidden]."""
        return self.model(input_ids, positions, kv_cache, metadata, self.cos_sin_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, fusing q/k/v and
        gate/up. Raises ValueError on an unknown name, a shape mismatch, or a missing weight."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(SKIPPED_SUFFIXES) or (self.lm_head is None and name == "lm_head.weight"):
                continue
            target, shard = self._target(name)
            if target not in params:
                raise ValueError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
            param = params[target]
            if shard is None:
                dest, key = param.data, target
            else:
                sizes = self.get_submodule(target.rsplit(".", 1)[0]).output_sizes
                start = sum(sizes[:shard])
                dest, key = param.data[start : start + sizes[shard]], f"{target}#{shard}"
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.update(self._shard_keys(target) if shard is None else (key,))
        expected = {key for target in params for key in self._shard_keys(target)}
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")

    def _target(self, name: str) -> tuple[str, int | None]:
        """HF name -> (our parameter name, shard index or None for a whole parameter)."""
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in FUSED_SHARDS:
            fused, shard = FUSED_SHARDS[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard
        return name, None

    def _shard_keys(self, target: str) -> list[str]:
        """The keys that together cover one parameter: one per shard for fused projections."""
        module = self.get_submodule(target.rsplit(".", 1)[0])
        if isinstance(module, MergedLinear):
            return [f"{target}#{i}" for i in range(len(module.output_sizes))]
        return [target]
