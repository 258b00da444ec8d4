"""xinserve's engine: paged KV cache, continuous batching, our own compact models.

Names are imported lazily so that the plain-Python core (``xinserve.engines.core.scheduler``, ``xinserve.engines.core.kv_cache``,
``xinserve.engines.core.sequence``) can be used without loading torch or transformers.
"""

import importlib

_EXPORTS = {
    "LLM": "xinserve.engines.llm",
    "CompletionOutput": "xinserve.engines.core.outputs",
    "EngineConfig": "xinserve.engines.config",
    "EngineStats": "xinserve.engines.core.outputs",
    "LLMEngine": "xinserve.engines.core.engine",
    "LoRARequest": "xinserve.engines.lora.request",
    "RequestOutput": "xinserve.engines.core.outputs",
    "SamplingParams": "xinserve.engines.core.sampling_params",
    "StepOutput": "xinserve.engines.core.outputs",
    "TokenLogprob": "xinserve.engines.core.outputs",
}

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "LoRARequest", "RequestOutput", "SamplingParams", "StepOutput", "TokenLogprob"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engines' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
