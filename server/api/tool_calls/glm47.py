"""GLM-4.7 / GLM-5: ``<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>``.

The same tags as GLM-4.5 (``glm45``), but its template writes them with nothing in between: the name
runs straight into the first ``<arg_key>`` and each value into the next key. Models trained on it
sometimes put whitespace or a literal backslash-n (the two characters) between the tags, so those
are skipped there, and only there: a value is taken exactly as written, typed back by the function's
parameter schema as in ``glm45``. A call without arguments is ``<tool_call>name</tool_call>``.
"""

import json
import re

from xinserve.server.api.tool_calls.base import ParsedOutput, ToolCall, content_or_none
from xinserve.server.api.tool_calls.glm45 import Glm45Parser

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_GAP = r"(?:\s|\\n)*"  # what may stand between two tags
_NAME = re.compile(rf"^{_GAP}([^<]*?){_GAP}(?=<arg_key>|$)", re.DOTALL)
_ARG = re.compile(rf"<arg_key>(.*?)</arg_key>{_GAP}<arg_value>(.*?)</arg_value>{_GAP}", re.DOTALL)


class Glm47Parser(Glm45Parser):
    """GLM-4.5's parser with GLM-4.7's layout; the values are typed as GLM-4.5's are (``_value``)."""

    def _parse(self, text: str) -> ParsedOutput:
        calls = []
        for body in _CALL.findall(text):
            name_match = _NAME.match(body)
            if name_match is None or not name_match.group(1):
                raise ValueError("a tool call without a name")
            name, pos, arguments = name_match.group(1), name_match.end(), {}
            while pos < len(body):
                arg = _ARG.match(body, pos)
                if arg is None:  # text between the arguments that is not one: not this format
                    raise ValueError(f"unexpected text in the tool call: {body[pos:pos + 40]!r}")
                key = arg.group(1).strip()
                arguments[key] = self._value(name, key, arg.group(2))
                pos = arg.end()
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        return ParsedOutput(content_or_none(text[: text.find("<tool_call>")]) if calls else text, calls)
