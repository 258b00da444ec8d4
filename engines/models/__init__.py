"""Supported architectures, keyed by ``config.architectures[0]``."""

from xinserve.engines.models.decoder import CausalLM
from xinserve.engines.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV32ForCausalLM
from xinserve.engines.models.glm4 import Glm4ForCausalLM
from xinserve.engines.models.glm4_moe import Glm4MoeForCausalLM
from xinserve.engines.models.glm_moe_dsa import GlmMoeDsaForCausalLM
from xinserve.engines.models.llama import LlamaForCausalLM
from xinserve.engines.models.mistral import MistralForCausalLM
from xinserve.engines.models.mixtral import MixtralForCausalLM
from xinserve.engines.models.qwen2 import Qwen2ForCausalLM
from xinserve.engines.models.qwen3 import Qwen3ForCausalLM
from xinserve.engines.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
    "Glm4MoeForCausalLM": Glm4MoeForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "GlmMoeDsaForCausalLM": GlmMoeDsaForCausalLM,
}

__all__ = ["MODEL_REGISTRY"]
