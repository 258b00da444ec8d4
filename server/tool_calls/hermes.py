"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` per call."""

import json
import re

from server.tool_calls.base import (
    ParsedOutput,
    ToolCall,
    ToolCallParser,
    arguments_text,
    content_or_none,
    function_name,
)

# The last call's end tag may be missing when the model stops on its end-of-turn token instead.
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesParser(ToolCallParser):
    start = ("<tool_call>",)

    def _parse(self, text: str) -> ParsedOutput:
        calls = []
        for body in _CALL.findall(text):
            call = json.loads(body)
            calls.append(ToolCall(function_name(call), arguments_text(call.get("arguments", {}))))
        return ParsedOutput(content_or_none(text[: text.find("<tool_call>")]) if calls else text, calls)
