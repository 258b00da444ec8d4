"""The decoder of the multi-head latent attention models (DeepSeek-V3, DeepSeek-V3.2, GLM-5): MLA
(``engines/models/mla.py``) with an optional DSA indexer per layer, then a dense SwiGLU MLP on the
first layers and the grouped-routing mixture of experts with shared experts after.

The model owns its KV-cache spec. Per token it caches, for every layer, the latent
(kv_lora_rank + qk_rope_head_dim values) and, for every layer with its own indexer, the indexer key
(index_head_dim values). The pool is one tensor of N * BS * (values per token) values, shaped
[N, BS, values per token] so that it carries N and BS; the model reads its storage as consecutive
per-layer segments, so each layer's latent cache is a contiguous [N, BS, R + dr] and each indexer
cache a contiguous [N, BS, Di], the layouts the paged kernels want. The block manager, prefix
caching, preemption and chunked prefill see blocks only, so they work unchanged.
"""

from collections.abc import Iterable
from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from xinserve.engines.models.decoder import CausalLM, DecoderModel, DecoderSpec
from xinserve.engines.models.dsa_indexer import Indexer
from xinserve.engines.models.mla import MLAAttention, MLAStep
from xinserve.engines.models.moe import grouped_moe
from xinserve.kernels import kv_quant
from xinserve.kernels.attention_metadata import AttentionMetadata
from xinserve.kernels.model_shapes import ModelShapes
from xinserve.kernels.ops import REFERENCE_OPS, KernelOps


class MLADecoderModel(DecoderModel):
    """``DecoderModel`` whose layers run ``MLAAttention``: each reads its segments of the pool and one
    ``MLAStep`` per step, which carries the DSA selection from a layer with an indexer to the layers
    after it that reuse it."""

    def __init__(self, config: Any, spec: DecoderSpec, ops: KernelOps, rope_is_neox: bool,
                 indexer_rope_is_neox: bool, indexer_layers: frozenset[int]) -> None:
        def attention(i: int) -> MLAAttention:
            indexer = Indexer(config, ops, indexer_rope_is_neox) if i in indexer_layers else None
            return MLAAttention(config, ops, rope_is_neox, indexer)

        super().__init__(config, replace(spec, rope_is_neox=rope_is_neox), ops, attention)
        self.indexer_rope_is_neox = indexer_rope_is_neox
        self.has_indexer = bool(indexer_layers)
        self.indexer_layers = indexer_layers
        self.latent_width = config.kv_lora_rank + config.qk_rope_head_dim
        self.index_head_dim = getattr(config, "index_head_dim", 0)
        self.keep_layers(range(config.num_hidden_layers))

    def keep_layers(self, layers: range) -> None:
        """Lay the pool out for ``layers`` only (a pipeline stage's; engines/parallel/pipeline_parallel.py): each
        kept layer's (first value per token, values per token), the latents first, then the indexer
        keys; a segment spans first * N * BS to (first + width) * N * BS."""
        latent = self.latent_width
        self.latent_segments = [(i * latent, latent) for i in range(len(layers))]
        start, self.index_segments = len(layers) * latent, []
        for i in layers:
            width = self.index_head_dim if i in self.indexer_layers else 0
            self.index_segments.append((start, width) if width else None)
            start += width
        self.values_per_token = start

    def step_inputs(self, positions: torch.Tensor, metadata: AttentionMetadata, cos_sin_cache: torch.Tensor,
                    dtype: torch.dtype) -> tuple:
        """(an ``MLAStep``,): the attention's and the indexer's rotations (one table when they rotate
        alike) and no selection yet."""
        cos_sin = self.rotary_cos_sin(positions, cos_sin_cache, self.rope_is_neox, dtype)
        index_cos_sin = cos_sin
        if self.has_indexer and self.indexer_rope_is_neox != self.rope_is_neox:
            index_cos_sin = self.rotary_cos_sin(positions, cos_sin_cache, self.indexer_rope_is_neox, dtype)
        return (MLAStep(metadata, cos_sin, index_cos_sin),)

    def layer_caches(self, kv_cache: torch.Tensor) -> Iterable[tuple[torch.Tensor, torch.Tensor | None]]:
        """kv_cache: [N, BS, values per token]; per layer (latent cache [N, BS, R + dr], indexer cache
        [N, BS, Di] or None), the contiguous segments of ``__init__``."""
        num_blocks, block_size = kv_cache.shape[:2]
        values = kv_cache.view(-1)

        def segment(first: int, width: int) -> torch.Tensor:  # [N, BS, width], contiguous
            per_value = num_blocks * block_size
            return values[first * per_value : (first + width) * per_value].view(num_blocks, block_size, width)

        return [(segment(*latent), index and segment(*index))
                for latent, index in zip(self.latent_segments, self.index_segments)]


class MLACausalLM(CausalLM):
    """A causal LM whose attention is MLA. Subclasses say the rotary styles and which layers run
    their own DSA indexer (``indexer_layers``; none: plain MLA)."""

    FLOAT32_PARAMETERS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "indexer.weights_proj.weight")
    INDEXER_ROPE_IS_NEOX: ClassVar[bool] = False
    # kv_b_proj is absorbed into the attention (mla.py); the DSA indexer reads weights_proj's float32 weight
    FLOAT_WEIGHTS: ClassVar[tuple[str, ...]] = ("kv_b_proj.weight", "indexer.weights_proj.weight")

    def __init__(self, config: Any, ops: KernelOps = REFERENCE_OPS) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = 1  # one latent, shared by every head
        self.head_dim = config.qk_rope_head_dim  # the rotary width: what the rotary table covers
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.model = MLADecoderModel(config, self.spec(config), ops, self.rope_is_neox(config),
                                     self.INDEXER_ROPE_IS_NEOX, self.indexer_layers(config))
        self.lm_head = None if self.tie_word_embeddings else nn.Linear(
            config.hidden_size, config.vocab_size, bias=False
        )
        self.ops = ops  # the logits' linear, as CausalLM's
        self.register_buffer("cos_sin_cache", self._build_rope_cache(), persistent=False)
        self.logits_gather = None  # tensor parallel: engines/models/tensor_parallel.py sets the gather
        self.absent_weights: tuple[str, ...] = ()  # pipeline parallel: another stage's weights
        self.mtp: nn.Module | None = None  # with speculative method mtp (engines/models/mtp.py)

    @staticmethod
    def spec(config: Any) -> DecoderSpec:
        """Grouped-routing experts (``xinserve.engines.models.moe.grouped_moe``) after the dense first layers."""
        moe, moe_layers = grouped_moe(config)
        return DecoderSpec(moe=moe, moe_layers=moe_layers)

    @staticmethod
    def rope_is_neox(config: Any) -> bool:
        """The attention's rotary style: interleaved pairs unless the config turns ``rope_interleave`` off."""
        return not getattr(config, "rope_interleave", True)

    @staticmethod
    def indexer_layers(config: Any) -> frozenset[int]:
        return frozenset()

    @classmethod
    def kernel_shapes(cls, config: Any, block_size: int = 16) -> ModelShapes:
        indexed = bool(cls.indexer_layers(config))
        rope = config.qk_rope_head_dim
        return replace(
            super().kernel_shapes(config, block_size),
            # the rotary the attention runs: interleaved or not by the architecture, on the rope dims
            # of each head and of the one shared key
            rope_is_neox=cls.rope_is_neox(config), head_dim=rope, rotary_dim=rope, num_kv_heads=1,
            kv_lora_rank=config.kv_lora_rank, qk_rope_head_dim=config.qk_rope_head_dim,
            mla_up_head_dims=(config.qk_nope_head_dim, config.v_head_dim),
            index_topk=config.index_topk if indexed else 0, index_n_heads=config.index_n_heads if indexed else 0,
            index_head_dim=config.index_head_dim if indexed else 0,
        )

    def kv_cache_shape(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> tuple[int, ...]:
        """[N, BS, L * (kv_lora_rank + qk_rope_head_dim) + indexer layers * index_head_dim]."""
        self.kv_bytes_per_token(dtype or torch.float32)  # refuses an 8-bit cache
        return (num_blocks, block_size, self.model.values_per_token)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        if kv_quant.is_quantized(dtype):
            raise ValueError(f"an 8-bit KV cache ({str(dtype).removeprefix('torch.')}) is not implemented for "
                             "MLA's latent cache yet; use kv_cache_dtype auto, bfloat16 or float16")
        return self.model.values_per_token * dtype.itemsize

    # forward: CausalLM's (kv_cache is ``kv_cache_shape``, the model's own layout)

    def _target(self, name: str) -> tuple[str, int | None, int | None]:
        # q_proj (MLA without q_lora_rank) is a projection of its own, not a shard of a fused qkv
        if name.endswith(".self_attn.q_proj.weight"):
            return name, None, None
        return super()._target(name)

    def _skipped(self, name: str) -> bool:
        """Also the multi-token-prediction layers (``model.layers.<num_hidden_layers>...``) when MTP is
        off (on, the loader renames them to ``mtp.*`` first: engines/models/mtp.py)."""
        parts = name.split(".")
        is_mtp_layer = parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= self.config.num_hidden_layers
        return is_mtp_layer or super()._skipped(name)
