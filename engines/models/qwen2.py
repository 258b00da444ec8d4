"""Qwen2: Llama with a bias on the q/k/v projections (none on o_proj); with ``use_sliding_window``,
the layers from ``max_window_layers`` on attend within ``sliding_window`` (``config.layer_types``)."""

from typing import Any

from xinserve.engines.models.decoder import CausalLM, DecoderSpec, layer_type_windows


class Qwen2ForCausalLM(CausalLM):
    @staticmethod
    def spec(config: Any) -> DecoderSpec:
        return DecoderSpec(qkv_bias=True, sliding_windows=layer_type_windows(config))
