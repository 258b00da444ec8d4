"""``tool_choice`` required or a named function: the output is forced by a JSON-schema grammar.

A named function's output is its arguments object. ``required`` writes an array of calls,
``[{"name": "f", "arguments": {...}}, ...]``; the engine's grammar writes JSON compactly with the
schema's property order (``engines/structured/schema.py``), so ``RequiredCalls`` reads the calls off
the growing text with a small scanner and streams each call's arguments as they are generated.
"""

from typing import Any

from xinserve.server.api.tool_calls.base import ToolCall

_NAME = '{"name": "'
_ARGUMENTS = '"arguments": '


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments schema; one without parameters takes an empty object."""
    return function.get("parameters") or {"type": "object", "properties": {}}


def required_schema(functions: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """One or more calls of the given functions (exactly one unless ``parallel``)."""
    items = [
        {"type": "object", "properties": {"name": {"enum": [f["name"]]}, "arguments": parameters_schema(f)},
         "required": ["name", "arguments"]}
        for f in functions
    ]
    schema: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedCall:
    """The whole output is the arguments of one call of ``name``."""

    def __init__(self, name: str) -> None:
        self.call = ToolCall(name, "")
        self.has_calls = True

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        first = not self.call.arguments and text
        self.call.arguments += text
        if first:
            return "", [{"index": 0, **self.call.to_dict()}]
        return "", [{"index": 0, "function": {"arguments": text}}] if text else []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        if self.call.arguments:
            return "", []
        return "", [{"index": 0, **self.call.to_dict()}]  # an empty output still names the call

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        return None, [ToolCall(self.call.name, text, self.call.id).to_dict()]


class RequiredCalls:
    """Calls read from ``[{"name": "f", "arguments": {...}}, ...]`` as it grows."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0  # how far the text is read
        self.state = "name"  # looking for: "name" -> "arguments" -> (inside) "value" -> "name"
        self.calls: list[ToolCall] = []
        self.depth = 0
        self.in_string = self.escaped = False
        self.has_calls = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += text
        deltas: list[dict[str, Any]] = []
        while self._advance(deltas):
            pass
        return "", deltas

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return "", []

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        reader = RequiredCalls()
        reader.feed(text)
        return None, [call.to_dict() for call in reader.calls]

    def _advance(self, deltas: list[dict[str, Any]]) -> bool:
        """Read what the text allows of the current state; False when it must wait for more."""
        if self.state == "name":
            start = self.text.find(_NAME, self.pos)
            end = self.text.find('"', start + len(_NAME)) if start >= 0 else -1
            if end < 0:
                return False
            self.calls.append(ToolCall(self.text[start + len(_NAME) : end], ""))
            self.has_calls = True
            deltas.append({"index": len(self.calls) - 1, **self.calls[-1].to_dict()})
            self.pos, self.state = end + 1, "arguments"
            return True
        if self.state == "arguments":
            start = self.text.find(_ARGUMENTS, self.pos)
            if start < 0:
                return False
            self.pos, self.state = start + len(_ARGUMENTS), "value"
            return True
        start, end = self.pos, self._scan_value()
        if end > start:
            self.calls[-1].arguments += self.text[start:end]
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": self.text[start:end]}})
        return self.state == "name"

    def _scan_value(self) -> int:
        """Move over the arguments' JSON; returns where the read stops (the value's end, once found)."""
        for i in range(self.pos, len(self.text)):
            char = self.text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.pos, self.state = i + 1, "name"
                    return i + 1
        self.pos = len(self.text)
        return self.pos
