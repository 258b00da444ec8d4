"""xinserve's engine: paged KV cache, continuous batching, our own compact models.

Names are imported lazily so that the plain-Python core (``engines.scheduler``, ``engines.kv_cache``,
``engines.sequence``) can be used without loading torch or transformers.
"""

import importlib

_EXPORTS = {
    "LLM": "engines.llm",
    "CompletionOutput": "engines.outputs",
    "EngineConfig": "engines.config",
    "EngineStats": "engines.outputs",
    "LLMEngine": "engines.engine",
    "RequestOutput": "engines.outputs",
    "SamplingParams": "engines.sampling_params",
    "StepOutput": "engines.outputs",
    "TokenLogprob": "engines.outputs",
}

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams", "StepOutput", "TokenLogprob"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engines' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
