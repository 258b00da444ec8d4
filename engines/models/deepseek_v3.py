"""DeepSeek-V3 / R1 (DeepseekV3ForCausalLM, model_type ``deepseek_v3``) and DeepSeek-V3.2
(DeepseekV32ForCausalLM, ``deepseek_v32``): multi-head latent attention with the query compressed
through ``q_lora_rank`` (or one ``q_proj`` when it is None, as in DeepSeek-V2-Lite), rotary on the
``qk_rope_head_dim`` slice in interleaved pairs (rotate-half when ``rope_interleave`` is off), YaRN
with ``mscale_all_dim`` scaling the softmax; dense MLPs on the first ``first_k_dense_replace`` layers
and grouped-routing experts with a shared expert after (engines/models/mla_decoder.py).

DeepSeek-V3.2 adds the DSA indexer on every layer, whose rotary is rotate-half (its attention's
stays interleaved)."""

from typing import Any

from xinserve.engines.models.mla_decoder import MLACausalLM


class DeepseekV3ForCausalLM(MLACausalLM):
    pass


class DeepseekV32ForCausalLM(MLACausalLM):
    INDEXER_ROPE_IS_NEOX = True

    @staticmethod
    def rope_is_neox(config: Any) -> bool:
        return False  # transformers rotates DeepSeek-V3.2's attention in interleaved pairs always

    @staticmethod
    def indexer_layers(config: Any) -> frozenset[int]:
        return frozenset(range(config.num_hidden_layers))
