"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention (per-head q/k RMSNorm) with a
mixture-of-experts MLP: softmax over the experts, the top ``num_experts_per_tok`` renormalised when
``norm_topk_prob``. Layers listed in ``mlp_only_layers``, or off the ``decoder_sparse_step``
stride, keep a dense MLP of ``intermediate_size``."""

from typing import Any

from xinserve.engines.models.decoder import CausalLM, DecoderSpec, uniform_windows
from xinserve.engines.models.moe import MoeSpec
from xinserve.kernels.routing import MoeRouting


class Qwen3MoeForCausalLM(CausalLM):
    @staticmethod
    def spec(config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        routing = MoeRouting(top_k=config.num_experts_per_tok, scoring="softmax",
                             renormalize=bool(config.norm_topk_prob))
        sparse = frozenset(
            i for i in range(config.num_hidden_layers)
            if i not in config.mlp_only_layers and config.num_experts > 0 and (i + 1) % config.decoder_sparse_step == 0
        )
        return DecoderSpec(
            qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_windows=uniform_windows(config),
            moe=MoeSpec(config.num_experts, config.moe_intermediate_size, routing), moe_layers=sparse,
        )
