"""Mixtral: Mistral's attention with a mixture-of-experts MLP on every layer: softmax over the
experts, the top ``num_experts_per_tok`` renormalised. Its checkpoints name the MoE block
``block_sparse_moe`` and an expert's projections ``w1`` (gate), ``w3`` (up) and ``w2`` (down)."""

from typing import Any, ClassVar

from xinserve.engines.models.decoder import CausalLM, DecoderSpec, uniform_windows
from xinserve.engines.models.moe import MoeSpec
from xinserve.kernels.routing import MoeRouting


class MixtralForCausalLM(CausalLM):
    CHECKPOINT_RENAMES: ClassVar[dict[str, str]] = {"block_sparse_moe": "mlp", "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    @staticmethod
    def spec(config: Any) -> DecoderSpec:
        routing = MoeRouting(top_k=config.num_experts_per_tok, scoring="softmax", renormalize=True)
        return DecoderSpec(
            sliding_windows=uniform_windows(config),
            moe=MoeSpec(config.num_local_experts, config.intermediate_size, routing),
            moe_layers=frozenset(range(config.num_hidden_layers)),
        )
