"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}``, optionally after
``<|python_tag|>``, several separated by ``;``."""

import json
import re

from xinserve.server.api.tool_calls.base import (
    ParsedOutput,
    ToolCall,
    ToolCallParser,
    arguments_text,
    content_or_none,
    function_name,
)

_PYTHON_TAG = "<|python_tag|>"
_CALL_START = re.compile(r'\{\s*"name"\s*:')


class Llama3JsonParser(ToolCallParser):
    start = (_PYTHON_TAG, '{"name"')

    def _parse(self, text: str) -> ParsedOutput:
        tag = text.find(_PYTHON_TAG)
        match = _CALL_START.search(text, tag + len(_PYTHON_TAG) if tag >= 0 else 0)
        if match is None:
            return ParsedOutput(text, [])
        before = text[: tag if tag >= 0 else match.start()]
        decoder, pos, calls = json.JSONDecoder(), match.start(), []
        while pos < len(text):
            call, pos = decoder.raw_decode(text, pos)
            # Llama's templates ask for "parameters"; some fine-tunes write "arguments".
            arguments = call["parameters"] if "parameters" in call else call.get("arguments", {})
            calls.append(ToolCall(function_name(call), arguments_text(arguments)))
            while pos < len(text) and text[pos] in "; \n\t":
                pos += 1
        return ParsedOutput(content_or_none(before), calls)
