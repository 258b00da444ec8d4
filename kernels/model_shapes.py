"""The model's shape record: what its kernels will see. The registry probes and times candidates on
inputs built from it; the runner, the loader and the models fill it from the model's config."""

from dataclasses import dataclass

import torch

from xinserve.kernels.quantized_weight import QuantShape
from xinserve.kernels.routing import MoeRouting


@dataclass(frozen=True, slots=True)
class ModelShapes:
    """What a model's kernels will see; the probes build their inputs from it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_is_neox: bool
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    block_size: int
    rms_norm_eps: float = 1e-6
    sliding_window: int | None = None  # the window of the model's windowed layers; None: no window
    num_experts: int = 0  # routed experts of a mixture-of-experts layer; 0: a dense model
    moe_intermediate_size: int = 0  # one expert's intermediate size
    moe_routing: MoeRouting | None = None
    # multi-head latent attention (0: the model has none): latent width R + dr and the query heads'
    # absorbed width are kv_lora_rank + qk_rope_head_dim
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    # MLA's per-head up-projected widths: (qk_nope_head_dim, v_head_dim), the no-rope key's and the value's
    mla_up_head_dims: tuple[int, int] = (0, 0)
    # the DSA indexer (0: none)
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    # the distinct quantized weights of a quantized checkpoint (kernels/quantized_weight.py); (): none
    quant_shapes: tuple[QuantShape, ...] = ()
    # the KV cache's storage dtype (--kv-cache-dtype, kernels/kv_quant.py); None: the model's dtype. The
    # probes build their caches in it, so a kernel that cannot read it is not chosen.
    kv_cache_dtype: torch.dtype | None = None
    # multi-LoRA (--enable-lora): the largest adapter rank and the adapter slots on the device; 0: no adapters
    max_lora_rank: int = 0
    max_loras: int = 0
