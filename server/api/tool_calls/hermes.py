"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`` per call."""

import json
import re

from xinserve.server.api.tool_calls.base import (
    ParsedOutput,
    ToolCall,
    ToolCallParser,
    arguments_text,
    function_name,
    tagged_calls,
)

# The last call's end tag may be missing when the model stops on its end-of-turn token instead.
_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesParser(ToolCallParser):
    start = ("<tool_call>",)

    def _parse(self, text: str) -> ParsedOutput:
        return tagged_calls(text, "<tool_call>", _CALL, _call)


def _call(body: str) -> ToolCall:
    call = json.loads(body)
    return ToolCall(function_name(call), arguments_text(call.get("arguments", {})))
