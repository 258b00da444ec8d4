"""What every tool-call parser shares: the call record, the parse result, JSON helpers."""

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ParsedOutput:
    content: str | None  # text outside the calls; None when there is none
    calls: list[ToolCall]


def arguments_text(value: Any) -> str:
    """Arguments as JSON text: a model may write them as an object or as a JSON string of one."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def function_name(call: Any) -> str:
    """A JSON call's ``name``; a name that is not a string makes the output malformed, like bad JSON
    (``ToolCallParser.parse`` then returns it all as content)."""
    name = call["name"]
    if not isinstance(name, str):
        raise TypeError(f"a tool call's name must be a string, got {type(name).__name__}")
    return name


def content_or_none(text: str) -> str | None:
    text = text.strip()
    return text or None


def tagged_calls(text: str, tag: str, bodies: re.Pattern, call: Callable[[str], ToolCall]) -> ParsedOutput:
    """Calls each written inside ``tag`` (``bodies`` captures one's inside): the text before the
    first is the content; no call, and all of it is."""
    calls = [call(body) for body in bodies.findall(text)]
    return ParsedOutput(content_or_none(text[: text.find(tag)]) if calls else text, calls)


class ToolCallParser:
    """Parses one family's tool-call syntax. ``start`` is the text that opens the calls: streamed
    content stops there (``server/api/tool_calls/stream.py``)."""

    start: tuple[str, ...] = ()

    def __init__(self, tools: list[dict[str, Any]]) -> None:
        self.tools = {t["function"]["name"]: t["function"] for t in tools}

    def parse(self, text: str) -> ParsedOutput:
        """The calls in ``text``, or all of it as content when it holds none that parse."""
        try:
            parsed = self._parse(text)
        except (ValueError, KeyError, TypeError, AttributeError):  # json.JSONDecodeError is a ValueError
            return ParsedOutput(text, [])
        return parsed if parsed.calls else ParsedOutput(text, [])

    def _parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def calls_start(self, text: str) -> int:
        """Where the calls begin in ``text``; -1 when they do not (yet)."""
        found = [i for i in (text.find(s) for s in self.start) if i >= 0]
        return min(found, default=-1)
