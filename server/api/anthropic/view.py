"""How a Messages API answer looks: one ``message``, or its event sequence.

The chat path's output reader (``server/api/openai/tools.py``: plain text, parsed or forced tool calls)
splits the text into content and calls; here they become ``text`` and ``tool_use`` blocks. Streamed:
``message_start``, ``ping``, then per block ``content_block_start``, its ``text_delta`` or
``input_json_delta`` deltas and ``content_block_stop``, then ``message_delta`` (stop reason, usage)
and ``message_stop``.
"""

from collections.abc import AsyncIterator
from typing import Any

from xinserve.server.api.anthropic import render
from xinserve.server.api.generate import GenerationGroup
from xinserve.server.api.generation import Delta
from xinserve.server.api.openai.tools import OutputPlan


class MessageView:
    def __init__(self, message_id: str, model: str, plan: OutputPlan, single_call: bool) -> None:
        """``single_call``: ``disable_parallel_tool_use``, so the first call is the only one kept."""
        self.message_id, self.model = message_id, model
        self.reader = plan.new_reader()
        self.max_calls = 1 if single_call else None
        self.block = -1  # index of the last block started
        self.open: str | int | None = None  # the open block: "text", or the call index of a tool_use
        self.made_calls = False

    def body(self, group: GenerationGroup) -> dict[str, Any]:
        (gen,) = group.gens
        choice = gen.choices[0]
        text, calls = self.reader.message(choice.text)
        calls = (calls or [])[: self.max_calls]
        content = [{"type": "text", "text": text}] if text else []
        content += [render.tool_use_block(call) for call in calls]
        reason, sequence = render.stop_reason(choice.finish_reason, bool(calls), choice.detokenizer.stop_string)
        return render.message(self.message_id, self.model, content, reason, sequence,
                              render.usage(group.prompt_tokens, group.completion_tokens))

    async def frames(self, group: GenerationGroup, firsts: list[list[Delta]]) -> AsyncIterator[dict[str, Any]]:
        (gen,) = group.gens
        start = render.message(self.message_id, self.model, [], None, None, render.usage(group.prompt_tokens, 0))
        yield {"type": "message_start", "message": start}
        yield {"type": "ping"}
        for delta in firsts[0]:
            for event in self._events(delta):
                yield event
        async for _, deltas in group.merged():
            for delta in deltas:
                for event in self._events(delta):
                    yield event
        for event in self._close():
            yield event
        choice = gen.choices[0]
        reason, sequence = render.stop_reason(choice.finish_reason, self.made_calls, choice.detokenizer.stop_string)
        yield {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": render.usage(group.prompt_tokens, group.completion_tokens)}
        yield {"type": "message_stop"}

    def _events(self, delta: Delta) -> list[dict[str, Any]]:
        text, calls = self.reader.feed(delta.text)
        if delta.finish_reason is not None:
            rest, more = self.reader.finish()
            text, calls = text + rest, calls + more
        events = []
        if text:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""}, "text")
            events.append(self._delta({"type": "text_delta", "text": text}))
        for call in calls:
            index = call["index"]
            if self.max_calls is not None and index >= self.max_calls:
                continue
            if "id" in call:  # a call's first delta names it
                block = {"type": "tool_use", "id": render.tool_use_id(call["id"]), "name": call["function"]["name"],
                         "input": {}}
                events += self._start(block, index)
                self.made_calls = True
            arguments = call.get("function", {}).get("arguments")
            if arguments:
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def _start(self, block: dict[str, Any], kind: str | int) -> list[dict[str, Any]]:
        events = self._close()
        self.block, self.open = self.block + 1, kind
        events.append({"type": "content_block_start", "index": self.block, "content_block": block})
        return events

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.block, "delta": delta}

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.block}]
