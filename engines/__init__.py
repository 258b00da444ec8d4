"""xinserve's engine: paged KV cache, continuous batching, our own compact models.

Names are imported lazily so that the plain-Python core (``xinserve.engines.scheduler``, ``xinserve.engines.kv_cache``,
``xinserve.engines.sequence``) can be used without loading torch or transformers.
"""

import importlib

_EXPORTS = {
    "LLM": "xinserve.engines.llm",
    "CompletionOutput": "xinserve.engines.outputs",
    "EngineConfig": "xinserve.engines.config",
    "EngineStats": "xinserve.engines.outputs",
    "LLMEngine": "xinserve.engines.engine",
    "RequestOutput": "xinserve.engines.outputs",
    "SamplingParams": "xinserve.engines.sampling_params",
    "StepOutput": "xinserve.engines.outputs",
    "TokenLogprob": "xinserve.engines.outputs",
}

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams", "StepOutput", "TokenLogprob"]


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engines' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
