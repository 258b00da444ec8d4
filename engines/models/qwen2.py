"""Qwen2: Llama with a bias on the q/k/v projections (none on o_proj)."""

from typing import Any

from engines.models.decoder import CausalLM, DecoderSpec


class Qwen2ForCausalLM(CausalLM):
    @staticmethod
    def spec(config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True)
