"""How one chat choice's text becomes content and tool calls, streamed or whole.

Each kind answers ``feed(text)`` and ``finish()`` with (content piece, tool-call deltas) while
streaming, and ``message(text)`` with (content, tool calls) for a whole response. ``has_calls``
says whether the choice made calls (its finish reason is then ``tool_calls``).
"""

from typing import Any

from xinserve.server.api.tool_calls.base import ToolCallParser


class PlainText:
    has_calls = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        return text, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        return "", []

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        return text, None


class ParsedCalls:
    """``tool_choice: auto``: the model's own call syntax, read by its family's parser.

    Content streams until the calls' opening marker (a suffix that may begin one is held back);
    from there the text is kept, and the calls go out whole when the choice ends, or the kept text
    as content when it did not parse as calls.
    """

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of text already streamed as content
        self.in_calls = False
        self.has_calls = False

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += text
        if self.in_calls:
            return "", []
        start = self.parser.calls_start(self.text)
        if start >= 0:
            self.in_calls = True
            end = start
        else:
            end = len(self.text) - _marker_prefix_length(self.text, self.parser.start)
        piece, self.sent = self.text[self.sent : end], max(self.sent, end)
        return piece, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        calls = self.parser.parse(self.text).calls if self.in_calls else []
        if not calls:
            piece, self.sent = self.text[self.sent :], len(self.text)
            return piece, []
        self.has_calls = True
        return "", [{"index": i, **call.to_dict()} for i, call in enumerate(calls)]

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        parsed = self.parser.parse(text)
        self.has_calls = bool(parsed.calls)
        return parsed.content, [call.to_dict() for call in parsed.calls] or None


def _marker_prefix_length(text: str, markers: tuple[str, ...]) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:n]):
                longest = n
                break
    return longest
