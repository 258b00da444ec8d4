"""Where each model family's reasoning starts, given the prompt it continues (vLLM's parser names).

- ``deepseek_r1``: DeepSeek-R1's template ends the prompt with ``<think>``, so the output starts inside
  the reasoning and often holds only ``</think>``; an output without it is all reasoning.
- ``qwen3``: reasoning only after a ``<think>`` (in the output, or left open at the end of the prompt, as
  the Qwen3 thinking-2507 templates do); ``enable_thinking: false`` in ``chat_template_kwargs``
  means no reasoning at all (the template writes an empty block into the prompt).
- ``glm45``: as qwen3, with "left open in the prompt" read after the last ``<|assistant|>``, as GLM's
  template writes an empty ``<think></think>`` into every earlier assistant turn (GLM-4.7/5 end the
  prompt with ``<think>``).
"""

from typing import Any

from xinserve.server.api.reasoning.think import END, START

NAMES = ("deepseek_r1", "qwen3", "glm45")
_ASSISTANT = "<|assistant|>"


def starts_in_reasoning(name: str, prompt_tail: str) -> bool:
    """Whether an output of parser ``name`` begins inside the reasoning; ``prompt_tail``: the end of the
    prompt's text (the last assistant turn's opening at least)."""
    if name == "deepseek_r1":
        return True
    if name == "glm45":
        prompt_tail = prompt_tail.rpartition(_ASSISTANT)[2]
    return prompt_tail.rfind(START) > prompt_tail.rfind(END)


def thinking_disabled(name: str, chat_template_kwargs: dict[str, Any] | None) -> bool:
    """``enable_thinking: false``: the qwen3 and glm45 templates then ask for no reasoning."""
    return name != "deepseek_r1" and (chat_template_kwargs or {}).get("enable_thinking") is False
