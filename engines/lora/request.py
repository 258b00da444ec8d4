"""The offline API's adapter choice (vLLM's ``LoRARequest``, without its integer id: the engine numbers
each load itself)."""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str
    lora_path: str
