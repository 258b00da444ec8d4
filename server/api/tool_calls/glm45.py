"""GLM-4.5 / GLM-4.6: ``<tool_call>name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>...</tool_call>``.

Its template writes a string value as it is and any other value as JSON, so a value is typed back
by the function's parameter schema. GLM-4's older form, a JSON object after the name, parses too.
"""

import json
import re
from typing import Any

from xinserve.server.api.tool_calls.base import ParsedOutput, ToolCall, ToolCallParser, tagged_calls

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


class Glm45Parser(ToolCallParser):
    start = ("<tool_call>",)

    def _parse(self, text: str) -> ParsedOutput:
        return tagged_calls(text, "<tool_call>", _CALL, self._call)

    def _call(self, body: str) -> ToolCall:
        body = body.strip()
        if "<arg_key>" in body:
            name = body[: body.index("<arg_key>")].strip()
            arguments = {key.strip(): self._value(name, key.strip(), value) for key, value in _ARG.findall(body)}
        else:  # GLM-4, or a call without arguments
            name, _, rest = body.partition("\n")
            arguments = json.loads(rest) if rest.strip() else {}
        if not name:
            raise ValueError("a tool call without a name")
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

    def _value(self, function: str, key: str, value: str) -> Any:
        schema = self.tools.get(function, {}).get("parameters", {}).get("properties", {}).get(key, {})
        if schema.get("type") == "string":
            return value
        try:
            return json.loads(value)
        except ValueError:
            return value
