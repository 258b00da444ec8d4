"""Reasoning in model output: ``<think>…</think>`` split from the answer (``reasoning_content``).

The model's ``reasoning_parser`` setting (``--reasoning-parser``) names the family (``parsers.NAMES``);
``reasoning_for`` builds one splitter factory per request, which the endpoints call once per choice.
Tool calls and structured output read only the content after the reasoning.
"""

from collections.abc import Callable
from typing import Any

from xinserve.server.api.reasoning.parsers import NAMES, starts_in_reasoning, thinking_disabled
from xinserve.server.api.reasoning.think import END, START, Split, ThinkSplitter

# Tokens of the prompt's end read for a ``<think>`` left open (far more than a generation prompt's
# opening, far fewer than a long prompt).
_PROMPT_TAIL_TOKENS = 64


def reasoning_for(
    name: str | None, tokenizer: Any, prompt_ids: list[int], chat_template_kwargs: dict[str, Any] | None
) -> Callable[[], ThinkSplitter] | None:
    """A factory of fresh splitters for this request's choices; None when its output has no reasoning."""
    if name is None or thinking_disabled(name, chat_template_kwargs):
        return None
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    if tail.rstrip().endswith(END):
        return None  # the template closed the block itself (thinking switched off): no reasoning
    inside = starts_in_reasoning(name, tail)
    return lambda: ThinkSplitter(inside)


def end_token_id(tokenizer: Any) -> int | None:
    """The id of ``</think>`` when the tokenizer has it as one token (structured output starts there)."""
    ids = tokenizer.encode(END, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


__all__ = ["END", "NAMES", "START", "Split", "ThinkSplitter", "end_token_id", "reasoning_for"]
