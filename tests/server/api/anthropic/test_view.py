"""Anthropic's event sequence and message from the chat path's output readers, fed by hand: text then a
GLM-4.7 tool call parsed with tool_choice auto, forced calls, and parallel calls cut to one."""

import asyncio
import json
from typing import Any

from xinserve.server.api.anthropic.view import MessageView
from xinserve.server.api.generation import Delta
from xinserve.server.api.openai.tools import OutputPlan
from xinserve.server.api.tool_calls.forced import NamedCall
from xinserve.server.api.tool_calls.glm47 import Glm47Parser
from xinserve.server.api.tool_calls.stream import ParsedCalls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
TWO_CALLS = ("I will check.<tool_call>get_weather<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
             "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>"
             "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>")


class _Choice:
    def __init__(self, text: str, finish_reason: str) -> None:
        self.text, self.finish_reason = text, finish_reason
        self.detokenizer = type("Detokenizer", (), {"stop_string": None})()


class _Group:
    """What the view reads of a ``GenerationGroup``: one generation's choice and the token counts."""

    def __init__(self, text: str, finish_reason: str) -> None:
        self.gens = [type("Gen", (), {"choices": [_Choice(text, finish_reason)]})()]
        self.prompt_tokens, self.completion_tokens = 11, 17

    async def merged(self):
        return
        yield


def _pieces(text: str, finish_reason: str, size: int = 4) -> list[Delta]:
    chunks = [text[i : i + size] for i in range(0, len(text), size)]
    return [Delta(0, c, [], None, finish_reason if i == len(chunks) - 1 else None) for i, c in enumerate(chunks)]


def _stream(view: MessageView, text: str, finish_reason: str = "stop") -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        return [e async for e in view.frames(_Group(text, finish_reason), [_pieces(text, finish_reason)])]

    return asyncio.run(run())


def _glm_view(single_call: bool = False) -> MessageView:
    return MessageView("msg_1", "glm", OutputPlan(None, lambda: ParsedCalls(Glm47Parser(TOOLS))), single_call)


def test_text_then_parsed_tool_calls_stream_as_blocks():
    events = _stream(_glm_view(), TWO_CALLS)
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "text"), (1, "tool_use"), (2, "tool_use")]
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1, 2]
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta" and e["index"] == 0)
    assert text == "I will check."
    inputs = ["".join(e["delta"]["partial_json"] for e in events
                      if e["type"] == "content_block_delta" and e["index"] == i) for i in (1, 2)]
    assert [json.loads(i) for i in inputs] == [{"city": "Oslo", "days": 2}, {"city": "Rome"}]
    assert starts[1]["content_block"]["id"].startswith("toolu_") and starts[1]["content_block"]["input"] == {}
    assert events[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[-2]["usage"] == {"input_tokens": 11, "output_tokens": 17}


def test_the_message_has_the_same_blocks():
    body = _glm_view().body(_Group(TWO_CALLS, "stop"))
    assert [b["type"] for b in body["content"]] == ["text", "tool_use", "tool_use"]
    assert body["content"][0]["text"] == "I will check."
    assert [b["input"] for b in body["content"][1:]] == [{"city": "Oslo", "days": 2}, {"city": "Rome"}]
    assert (body["stop_reason"], body["stop_sequence"]) == ("tool_use", None)
    assert body["usage"] == {"input_tokens": 11, "output_tokens": 17}


def test_disabled_parallel_tool_use_keeps_the_first_call():
    events = _stream(_glm_view(single_call=True), TWO_CALLS)
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == ["text", "tool_use"]
    body = _glm_view(single_call=True).body(_Group(TWO_CALLS, "stop"))
    assert [b["type"] for b in body["content"]] == ["text", "tool_use"]


def test_a_forced_call_cut_by_max_tokens_says_so():
    view = MessageView("msg_2", "m", OutputPlan("{}", lambda: NamedCall("get_weather")), False)
    events = _stream(view, '{"city": "Os')
    assert [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"] == ["tool_use"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    cut = MessageView("msg_3", "m", OutputPlan("{}", lambda: NamedCall("get_weather")), False)
    body = cut.body(_Group('{"city": "Os', "length"))
    assert body["stop_reason"] == "max_tokens" and body["content"][0]["input"] == {}


def test_plain_text_without_output_has_no_blocks():
    view = MessageView("msg_4", "m", OutputPlan(None, lambda: ParsedCalls(Glm47Parser(TOOLS))), False)
    events = _stream(view, "")
    assert [e["type"] for e in events] == ["message_start", "ping", "message_delta", "message_stop"]
