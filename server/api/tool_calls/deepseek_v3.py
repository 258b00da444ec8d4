"""DeepSeek-V3: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{...}\n```
<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``; V3.1's ``<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}`` too."""

import json
import re

from xinserve.server.api.tool_calls.base import ParsedOutput, ToolCall, ToolCallParser, content_or_none

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_FENCED = re.compile(r"^(.*?)\n```(?:json)?\n(.*)\n```$", re.DOTALL)


class DeepSeekV3Parser(ToolCallParser):
    start = (CALLS_BEGIN,)

    def _parse(self, text: str) -> ParsedOutput:
        begin = text.find(CALLS_BEGIN)
        if begin < 0:
            return ParsedOutput(text, [])
        calls = []
        for kind, body in _CALL.findall(text, begin):
            if kind.strip() == "function":  # V3: the name, then the arguments in a json fence
                fenced = _FENCED.match(body.strip())
                if fenced is None:
                    raise ValueError("a DeepSeek-V3 tool call without its json block")
                name, arguments = fenced.group(1), fenced.group(2)
            else:  # V3.1: the name before the separator
                name, arguments = kind, body
            json.loads(arguments)  # malformed arguments make the whole output content
            calls.append(ToolCall(name.strip(), arguments.strip()))
        return ParsedOutput(content_or_none(text[:begin]), calls)
