"""Llama (and Mistral, which shares its layout): the plain ``CausalLM``.

Biases follow ``config.attention_bias`` / ``config.mlp_bias``; rotary is rotate-half, with
"default", "linear" or "llama3" scaling. Mistral's sliding window is not applied, so contexts
must stay within ``config.sliding_window``.
"""

from engines.models.decoder import CausalLM


class LlamaForCausalLM(CausalLM):
    """The base layout unchanged; a named class for the registry and error messages."""
