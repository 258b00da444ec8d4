"""Anthropic response pieces as plain dicts: the message, its content blocks, stop reason and usage."""

import json
from typing import Any


def tool_use_id(call_id: str) -> str:
    """Anthropic's ``toolu_`` prefix on the chat path's ``call_`` id (the same random part)."""
    return "toolu_" + call_id.removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the ``input`` object; ``{}`` when they are not one (an output cut
    off by ``max_tokens``: the stop reason says so)."""
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use_block(call: dict[str, Any]) -> dict[str, Any]:
    """A chat tool call (``{"id", "function": {"name", "arguments"}}``) as a ``tool_use`` block."""
    function = call["function"]
    return {"type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"],
            "input": tool_input(function["arguments"])}


def stop_reason(finish_reason: str | None, made_calls: bool, stop_string: str | None) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` from the engine's finish reason: "length" is ``max_tokens``;
    a stop after tool calls ``tool_use``; a stop string ``stop_sequence``; else ``end_turn``."""
    if finish_reason == "length":
        return "max_tokens", None
    if made_calls:
        return "tool_use", None
    if stop_string is not None:
        return "stop_sequence", stop_string
    return "end_turn", None


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


def message(
    message_id: str, model: str, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
    usage_: dict[str, int],
) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage_}
