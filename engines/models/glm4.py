"""GLM-4 (Glm4ForCausalLM, model_type ``glm4``): q/k/v bias, interleaved rotary on the first
``partial_rotary_factor`` of each head, and extra RMSNorms on the attention and MLP outputs
(``post_self_attn_layernorm``, ``post_mlp_layernorm``). Its checkpoint already stores the fused
``gate_up_proj``."""

from typing import Any

from xinserve.engines.models.decoder import CausalLM, DecoderSpec


class Glm4ForCausalLM(CausalLM):
    @staticmethod
    def spec(config: Any) -> DecoderSpec:
        return DecoderSpec(
            qkv_bias=bool(getattr(config, "attention_bias", True)), rope_is_neox=False, sandwich_norm=True
        )
