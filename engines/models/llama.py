"""Llama: the plain ``CausalLM``.

Biases follow ``config.attention_bias`` / ``config.mlp_bias``; rotary is rotate-half, with
"default", "linear" or "llama3" scaling.
"""

from xinserve.engines.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    """The base layout unchanged; a named class for the registry and error messages."""
