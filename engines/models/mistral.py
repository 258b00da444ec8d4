"""Mistral: Llama's layout (no biases) with a sliding window on every layer when
``config.sliding_window`` is set (Mistral 7B v0.1: 4096)."""

from typing import Any

from xinserve.engines.models.decoder import CausalLM, DecoderSpec, uniform_windows


class MistralForCausalLM(CausalLM):
    @staticmethod
    def spec(config: Any) -> DecoderSpec:
        return DecoderSpec(sliding_windows=uniform_windows(config))
