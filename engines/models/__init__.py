"""Supported architectures, keyed by ``config.architectures[0]``."""

from engines.models.decoder import CausalLM
from engines.models.glm4 import Glm4ForCausalLM
from engines.models.llama import LlamaForCausalLM
from engines.models.qwen2 import Qwen2ForCausalLM
from engines.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Glm4ForCausalLM": Glm4ForCausalLM,
}

__all__ = ["MODEL_REGISTRY"]
