"""GLM-5 (GlmMoeDsaForCausalLM, model_type ``glm_moe_dsa``): DeepSeek-V3.2's design (MLA with a
DSA indexer, grouped-routing experts with a shared expert) with interleaved rotary in the indexer
too, and cross-layer top-k sharing: a layer that ``indexer_types`` marks "shared" has no indexer
(and no indexer cache) and attends to the positions the previous layer selected."""

from typing import Any

from xinserve.engines.models.mla_decoder import MLACausalLM


class GlmMoeDsaForCausalLM(MLACausalLM):
    INDEXER_ROPE_IS_NEOX = False

    @staticmethod
    def rope_is_neox(config: Any) -> bool:
        return False

    @staticmethod
    def indexer_layers(config: Any) -> frozenset[int]:
        types = getattr(config, "indexer_types", None) or ["full"] * config.num_hidden_layers
        if types[0] != "full":
            raise ValueError(f"GlmMoeDsaForCausalLM: indexer_types[0] is {types[0]!r}; the first layer must run "
                             "its own indexer (a 'shared' layer reuses the previous layer's selection)")
        return frozenset(i for i, kind in enumerate(types) if kind == "full")
