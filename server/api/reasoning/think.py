"""The ``<think>…</think>`` splitter every reasoning parser shares: model output -> reasoning and content.

Fed the output piece by piece (stream deltas), it answers each piece with (reasoning, content) as soon
as it can tell them apart: a piece that ends with the start of a tag (``"</th"``) is held back until
the next piece says whether the tag completes, so a tag split over tokens or deltas is never shown.
The whole-text ``split`` is the same machine fed once, so streamed and whole answers always agree.
"""

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(slots=True)
class Split:
    reasoning: str
    content: str


class ThinkSplitter:
    """States: "before" (content; a ``<think>`` opens reasoning), "reasoning" (until ``</think>``),
    "after" (content to the end; later tags are text). ``in_reasoning``: the output starts inside the
    reasoning (its ``<think>`` was in the prompt); a leading ``<think>`` is then dropped all the same."""

    def __init__(self, in_reasoning: bool) -> None:
        self.state = "reasoning" if in_reasoning else "before"
        self.pending = ""  # text held back: it may be the start of the tag being looked for
        self.saw_reasoning = in_reasoning
        self.ended = False  # ``</think>`` has been read
        self._skip_start = in_reasoning  # a leading "<think>" is still possible and would be dropped

    def feed(self, text: str) -> Split:
        out = Split("", "")
        text = self.pending + text
        self.pending = ""
        while text:
            if self._skip_start:
                stripped = text.lstrip()
                if START.startswith(stripped) and len(stripped) < len(START):
                    self.pending = text  # maybe the start of a leading "<think>": wait
                    return out
                self._skip_start = False
                if stripped.startswith(START):
                    text = stripped[len(START):]
                    continue
            if self.state == "after":
                out.content += text
                break
            tag = START if self.state == "before" else END
            found = text.find(tag)
            if found >= 0:
                self._emit(out, text[:found])
                text = text[found + len(tag):]
                self.state = "reasoning" if self.state == "before" else "after"
                self.saw_reasoning = True
                self.ended = self.ended or self.state == "after"
                continue
            keep = _prefix_suffix(text, tag)
            self._emit(out, text[: len(text) - keep])
            self.pending = text[len(text) - keep:]
            break
        return out

    def take(self, text: str, last: bool) -> Split:
        """``feed``, and ``finish`` too when ``text`` is the output's last piece."""
        out = self.feed(text)
        if last:
            rest = self.finish()
            out.reasoning, out.content = out.reasoning + rest.reasoning, out.content + rest.content
        return out

    def finish(self) -> Split:
        """What was held back, in the channel it was read in: the output ended mid-tag."""
        out = Split("", "")
        self._emit(out, self.pending)
        self.pending = ""
        return out

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output as (reasoning, content); reasoning None when the output has none."""
        first, last = self.feed(text), self.finish()
        reasoning = first.reasoning + last.reasoning
        return (reasoning if self.saw_reasoning else None), first.content + last.content

    def _emit(self, out: Split, text: str) -> None:
        if self.state == "reasoning":
            out.reasoning += text
        else:
            out.content += text


def _prefix_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
