"""GLM-4.5 / GLM-4.5-Air (Glm4MoeForCausalLM, model_type ``glm4_moe``): rotate-half rotary on the
first ``partial_rotary_factor`` of each head, q/k/v bias, optional per-head q/k RMSNorm
(``use_qk_norm``), dense MLPs on the first ``first_k_dense_replace`` layers and mixture-of-experts
ones after: sigmoid scores, the experts chosen by score plus ``e_score_correction_bias`` within the
best ``topk_group`` of ``n_group`` groups, weighted by their unbiased scores (renormalised when
``norm_topk_prob``) times ``routed_scaling_factor``, plus ``n_shared_experts`` shared experts that
see every token. The router stays in float32, as in transformers.

Its checkpoints also hold the multi-token-prediction layers (``model.layers.<num_hidden_layers>...``)
used for speculative decoding; they are skipped unless speculative method ``mtp`` loads them
(engines/models/mtp.py)."""

from typing import Any

from xinserve.engines.models.decoder import CausalLM, DecoderSpec
from xinserve.engines.models.moe import grouped_moe


class Glm4MoeForCausalLM(CausalLM):
    FLOAT32_PARAMETERS = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

    @staticmethod
    def spec(config: Any) -> DecoderSpec:
        moe, moe_layers = grouped_moe(config)
        return DecoderSpec(
            qkv_bias=bool(config.attention_bias), qk_norm=bool(config.use_qk_norm), moe=moe, moe_layers=moe_layers,
        )

    def _skipped(self, name: str) -> bool:
        parts = name.split(".")
        is_mtp_layer = parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) >= self.config.num_hidden_layers
        return is_mtp_layer or super()._skipped(name)
