"""The decoder-only causal LM every supported architecture is built from.

An architecture differs only in a ``DecoderSpec`` (biases, q/k norm, rotary style, extra norms, each
layer's sliding window, which layers are mixture-of-experts and how they route); each model file
subclasses ``CausalLM`` and overrides ``spec``. Parameter names mirror the Hugging Face checkpoints
except for the fused ``qkv_proj`` and ``gate_up_proj`` and the stacked routed experts.
"""

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from xinserve.engines.models.layers import Attention, GatedMLP, RMSNorm
from xinserve.engines.models.moe import Experts, MoeSpec, SparseMoeBlock
from xinserve.engines.models.rope import build_cos_sin_cache, rotary_dim
from xinserve.kernels import kv_quant
from xinserve.kernels.attention_metadata import AttentionMetadata
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.ops import REFERENCE_OPS, KernelOps

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
    # each layer's sliding window (None: that layer sees the whole context); (): no layer has one
    sliding_windows: tuple[int | None, ...] = ()
    moe: MoeSpec | None = None  # the experts of the layers in moe_layers; the other layers are dense
    moe_layers: frozenset[int] = frozenset()


def uniform_windows(config: Any) -> tuple[int | None, ...]:
    """Every layer attends within ``config.sliding_window`` (Mistral, Mixtral, Qwen3-MoE, whose
    configs leave it None when the window is off)."""
    window = getattr(config, "sliding_window", None)
    return () if window is None else (window,) * config.num_hidden_layers


def layer_type_windows(config: Any) -> tuple[int | None, ...]:
    """The layers that ``config.layer_types`` marks "sliding_attention" attend within
    ``config.sliding_window`` (Qwen2 / Qwen3: with ``use_sliding_window``, the layers from
    ``max_window_layers`` on); the loader refuses any other layer type."""
    types = getattr(config, "layer_types", None) or ()
    if "sliding_attention" not in types:
        return ()
    return tuple(config.sliding_window if kind == "sliding_attention" else None for kind in types)


class DecoderLayer(nn.Module):
    """Pre-norm attention then MLP (dense, or mixture-of-experts on ``spec.moe_layers``), with GLM-4's
    sandwich norms when the spec asks. ``self_attn`` is the architecture's attention (``Attention``, or
    MLA), called as ``self_attn(hidden, *layer_caches, *step_inputs)``."""

    def __init__(self, config: Any, spec: DecoderSpec, ops: KernelOps, layer_idx: int, self_attn: nn.Module) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = self_attn
        if layer_idx in spec.moe_layers:
            self.mlp = SparseMoeBlock(hidden, spec.moe, ops)
        else:
            self.mlp = GatedMLP(hidden, config.intermediate_size, bias=spec.mlp_bias, ops=ops)
        self.input_layernorm = RMSNorm(hidden, eps, ops)
        self.post_attention_layernorm = RMSNorm(hidden, eps, ops)
        self.post_self_attn_layernorm = RMSNorm(hidden, eps, ops) if spec.sandwich_norm else None
        self.post_mlp_layernorm = RMSNorm(hidden, eps, ops) if spec.sandwich_norm else None

    def forward(
        self, hidden: torch.Tensor, residual: torch.Tensor | None, caches: tuple, step_inputs: tuple
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried separately and added inside the next norm (fused add).
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, *caches, *step_inputs)
        if self.post_self_attn_layernorm is not None:
            hidden = self.post_self_attn_layernorm(hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        hidden = self.mlp(hidden)
        if self.post_mlp_layernorm is not None:
            hidden = self.post_mlp_layernorm(hidden)
        return hidden, residual


class DecoderModel(nn.Module):
    """Embedding, the layers, the final norm. What an attention takes besides the hidden states is
    this class's to say: ``layer_caches`` (each layer's views of the step's KV tensor) and
    ``step_inputs`` (what every layer shares, built once per step); MLA overrides both."""

    def __init__(self, config: Any, spec: DecoderSpec, ops: KernelOps,
                 attention: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.rope_is_neox = spec.rope_is_neox
        self.rotary_cos_sin = ops.rotary_cos_sin
        # Given its (empty) weight, the embedding skips its normal_ init: on the meta device (the loader's)
        # that runs through torch._refs, whose first use imports dynamo (~2 CPU s of every engine's start).
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        self.layers = nn.ModuleList(
            DecoderLayer(config, spec, ops, i, attention(i)) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.pipeline: Callable | None = None  # a pipeline stage runs the forward (engines/parallel/pipeline_parallel.py)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        cos_sin_cache: torch.Tensor,
    ) -> torch.Tensor | None:
        if self.pipeline is not None:
            return self.pipeline(self, input_ids, positions, kv_cache, metadata, cos_sin_cache)
        hidden, residual = self.embed_tokens(input_ids), None  # hidden: [T, hidden]
        # Everything that depends only on the step is built here once, not in every layer.
        step_inputs = self.step_inputs(positions, metadata, cos_sin_cache, hidden.dtype)
        for layer, caches in zip(self.layers, self.layer_caches(kv_cache)):
            hidden, residual = layer(hidden, residual, caches, step_inputs)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def step_inputs(self, positions: torch.Tensor, metadata: AttentionMetadata, cos_sin_cache: torch.Tensor,
                    dtype: torch.dtype) -> tuple:
        """(metadata, the rotation of each position)."""
        return metadata, self.rotary_cos_sin(positions, cos_sin_cache, self.rope_is_neox, dtype)

    def layer_caches(self, kv_cache: torch.Tensor) -> Iterable[tuple[torch.Tensor, ...]]:
        """Per layer (key_cache, value_cache): kv_cache[0][i], kv_cache[1][i], each [N, BS, KVH, D]."""
        return zip(kv_cache[0].unbind(0), kv_cache[1].unbind(0))


def dense_attention(config: Any, spec: DecoderSpec, head_dim: int, ops: KernelOps) -> Callable[[int], nn.Module]:
    """Layer index -> that layer's ``Attention`` (its sliding window, if any, from the spec)."""
    return lambda i: Attention(
        config.hidden_size, config.num_attention_heads, config.num_key_value_heads, head_dim,
        qkv_bias=spec.qkv_bias, o_bias=spec.o_bias, qk_norm_eps=config.rms_norm_eps if spec.qk_norm else None,
        rope_is_neox=spec.rope_is_neox, ops=ops,
        sliding_window=spec.sliding_windows[i] if spec.sliding_windows else None,
    )


class CausalLM(nn.Module):
    """Llama-shaped causal LM. Subclasses choose the architecture's ``spec``; ``ops`` are the
    kernels it calls (the registry's choice for the device). The loader refuses configs that ask
    for math this class does not implement (engines/models/config_check.py)."""

    # checkpoint name component -> ours (an architecture whose checkpoints use other module names)
    CHECKPOINT_RENAMES: ClassVar[dict[str, str]] = {}
    # parameters (by name suffix) kept in float32 whatever the model's dtype, as transformers keeps them
    FLOAT32_PARAMETERS: ClassVar[tuple[str, ...]] = ()
    # weights (by name suffix) the model reads directly instead of multiplying through a Linear: a
    # quantized checkpoint's record for one is dequantized at load (engines/quantization/install.py)
    FLOAT_WEIGHTS: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: Any, ops: KernelOps = REFERENCE_OPS) -> None:
        super().__init__()
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = self.config_head_dim(config)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        spec = self.spec(config)
        self.model = DecoderModel(config, spec, ops, dense_attention(config, spec, self.head_dim, ops))
        # Tied: the logits reuse the embedding matrix, there is no separate lm_head.
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )
        self.ops = ops  # the logits' linear (swapped with the layers' when a kernel is built: engines/worker/warmup.py)
        # [max_positions, rotary_dim], filled by reset_buffers once the loader has materialised the model
        # built on the meta device (computed there, it would run through torch._refs, as the embedding's init).
        rope_shape = (config.max_position_embeddings, rotary_dim(config, self.head_dim))
        self.register_buffer("cos_sin_cache", torch.empty(rope_shape), persistent=False)
        # Tensor parallel: gathers each rank's vocabulary slice of the logits (models/tensor_parallel.py)
        self.logits_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Pipeline parallel: checkpoint name prefixes another stage holds (engines/parallel/pipeline_parallel.py)
        self.absent_weights: tuple[str, ...] = ()
        self.mtp: nn.Module | None = None  # the checkpoint's MTP layer, with speculative method mtp (models/mtp.py)

    @staticmethod
    def config_head_dim(config: Any) -> int:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads

    @classmethod
    def kernel_shapes(cls, config: Any, block_size: int = 16) -> ModelShapes:
        """What this model's kernels will see, for the kernel registry's probes."""
        head_dim = cls.config_head_dim(config)
        spec = cls.spec(config)
        # one window per model in every supported architecture (its windowed layers share it)
        windows = {window for window in spec.sliding_windows if window is not None}
        moe = spec.moe if spec.moe_layers else None
        return ModelShapes(
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            rotary_dim=rotary_dim(config, head_dim),
            rope_is_neox=spec.rope_is_neox,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            block_size=block_size,
            rms_norm_eps=config.rms_norm_eps,
            sliding_window=max(windows) if windows else None,
            num_experts=moe.num_experts if moe else 0,
            moe_intermediate_size=moe.intermediate_size if moe else 0,
            moe_routing=moe.routing if moe else None,
        )

    @staticmethod
    def spec(config: Any) -> DecoderSpec:
        return DecoderSpec(
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
        )

    def kv_cache_shape(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> tuple[int, ...]:
        """The worker's one KV tensor: [2 (key, value), KV layers, blocks, block_size, kv_heads, head_dim], the
        last dim head_dim + 4 for an 8-bit ``dtype`` (each head's codes, then its scale: kernels/kv_quant.py)."""
        width = self.head_dim if dtype is None else kv_quant.head_width(self.head_dim, dtype)
        return (2, self.num_kv_layers, num_blocks, block_size, self.num_kv_heads, width)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What one token costs in that tensor (stored in ``dtype``), over every layer."""
        return 2 * self.num_kv_layers * self.num_kv_heads * kv_quant.head_bytes(self.head_dim, dtype)

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache layer: the decoder's, plus the MTP layer's when it is loaded."""
        return self.num_layers + (self.mtp is not None)

    def _build_rope_cache(self) -> torch.Tensor:
        dim = rotary_dim(self.config, self.head_dim)
        return build_cos_sin_cache(dim, self.config.max_position_embeddings, self.config)

    def reset_buffers(self) -> None:
        """Recompute the derived buffers on the model's device and dtype (the loader calls this
        after materialising a model built on the meta device)."""
        self.cos_sin_cache = self._build_rope_cache().to(self.cos_sin_cache.device, self.cos_sin_cache.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64; kv_cache: ``kv_cache_shape(...)`` (dense: [2, L, N, BS, KVH, D]).
        Returns [T, hidden]."""
        return self.model(input_ids, positions, kv_cache, metadata, self.cos_sin_cache)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] float32."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.ops.linear(hidden, weight).float()
        return logits if self.logits_gather is None else self.logits_gather(logits)

    def keep_float32_parameters(self) -> None:
        """Put ``FLOAT32_PARAMETERS`` back in float32 after the model was cast to its dtype."""
        for name, param in self.named_parameters():
            if name.endswith(self.FLOAT32_PARAMETERS):
                param.data = param.data.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) into the parameters, fusing q/k/v and
        gate/up and stacking the routed experts. Raises ValueError on an unknown name, a shape
        mismatch, or a missing weight."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if self._skipped(name):
                continue
            target, expert, shard = self._target(name)
            if target not in params:
                raise ValueError(f"checkpoint weight {name!r} has no place in {type(self).__name__}")
            if expert is not None:
                expert = self.get_submodule(target.rsplit(".", 1)[0]).slot(expert)
                if expert is None:  # another rank's expert (expert parallel)
                    continue
            dest, key = params[target].data, target
            if expert is not None:  # one expert's slice of a stacked [E, ...] parameter
                dest, key = dest[expert], f"{key}#e{expert}"
            if shard is not None:  # one projection's rows of a fused one
                sizes = self.get_submodule(target.rsplit(".", 1)[0]).output_sizes
                start = sum(sizes[:shard])
                dest, key = dest[start : start + sizes[shard]], f"{key}#s{shard}"
            if dest.shape != tensor.shape:
                raise ValueError(f"checkpoint weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.update(self._shard_keys(target) if key == target else (key,))
        expected = {key for target in params for key in self._shard_keys(target)}
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")

    def _skipped(self, name: str) -> bool:
        """Checkpoint entries that are not this model's weights (derived tables, a tied lm_head)."""
        return (name.endswith(SKIPPED_SUFFIXES) or (self.lm_head is None and name == "lm_head.weight")
                or name.startswith(self.absent_weights))

    def _target(self, name: str) -> tuple[str, int | None, int | None]:
        """HF name -> (our parameter name, expert index or None, shard index or None); None: the
        whole parameter, or every expert."""
        parts = [self.CHECKPOINT_RENAMES.get(part, part) for part in name.split(".")]
        # mlp.experts.<e>.<proj>.weight -> the stacked mlp.experts.gate_up_proj / down_proj
        if len(parts) >= 4 and parts[-4] == "experts" and parts[-3].isdigit() and parts[-1] == "weight":
            fused, shard = FUSED_SHARDS.get(parts[-2], (parts[-2], None))
            return ".".join([*parts[:-3], fused]), int(parts[-3]), shard
        if len(parts) >= 2 and parts[-2] in FUSED_SHARDS:
            fused, shard = FUSED_SHARDS[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), None, shard
        return ".".join(parts), None, None

    def _shard_keys(self, target: str) -> list[str]:
        """The keys that together cover one parameter: one per expert of a stacked one, times one
        per shard of a fused projection."""
        module_name, leaf = target.rsplit(".", 1)
        module = self.get_submodule(module_name)
        keys = [target]
        if isinstance(module, Experts):
            keys = [f"{target}#e{e}" for e in range(module.num_experts)]
        # a fused projection (MergedLinear, or a quantized one standing in for it) is loaded per shard
        fused = hasattr(module, "output_sizes") and not isinstance(module, Experts)
        if fused or (isinstance(module, Experts) and leaf == "gate_up_proj"):
            keys = [f"{key}#s{s}" for key in keys for s in range(len(module.output_sizes))]
        return keys
