"""Qwen3: Llama with an RMSNorm over each head's query and key before rotary."""

from typing import Any

from engines.models.decoder import CausalLM, DecoderSpec


class Qwen3ForCausalLM(CausalLM):
    @staticmethod
    def spec(config: Any) -> DecoderSpec:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderSpec(qkv_bias=bias, o_bias=bias, qk_norm=True)
