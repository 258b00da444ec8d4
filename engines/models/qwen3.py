"""Qwen3: Llama with an RMSNorm over each head's query and key before rotary; sliding-window layers
as Qwen2's (``config.layer_types``)."""

from typing import Any

from xinserve.engines.models.decoder import CausalLM, DecoderSpec, layer_type_windows


class Qwen3ForCausalLM(CausalLM):
    @staticmethod
    def spec(config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm=True, sliding_windows=layer_type_windows(config))
