"""Hostile text and JSON against every endpoint that tokenises, over one kept-alive connection.

Each text field of each endpoint gets a lone surrogate (as a JSON escape and as raw bytes), a NUL,
1 MB of combining marks, and JSON nested far deeper than any real request (in the body, and inside
the strings that hold JSON, such as tool-call arguments). Pinned: every answer is a 4xx envelope or
a 200, never a 5xx; a lone surrogate is a 400 naming its field; the connection is never dropped;
the server's log grows by a line per request, never by a traceback.
"""

import json
from typing import Any

import httpx
import pytest

MODEL = "tiny"
HOLE = "\x00HOLE"  # where a template takes the hostile value
DEPTH = 500  # once a RecursionError (a 500) in the templating; the edge allows 64
DEEP_LIST = b"[" * DEPTH + b"]" * DEPTH
DEEP_OBJECT = b'{"a":' * DEPTH + b"1" + b"}" * DEPTH
VERY_DEEP = b"[" * 100_000 + b"]" * 100_000  # past the JSON parser's own limit

# name -> the JSON text that replaces the hole (the hole is a JSON string in every template).
SURROGATES = {
    "lone high surrogate": b'"a\\ud800b"',
    "lone low surrogate": b'"\\udc00"',
    "high surrogate then text": b'"\\ud83dx"',
    "raw surrogate bytes": b'"a\xed\xa0\x80b"',  # what Python's json decodes with surrogatepass
}
PAYLOADS = {
    **SURROGATES,
    "nul": json.dumps("a\x00b").encode(),
    "1 MB of combining marks": json.dumps("a" + "\u0301" * 1_000_000).encode(),
    "combining marks within the limits": json.dumps("a" + "\u0301" * 5_000).encode(),
    "deep list": DEEP_LIST,
    "deep object": DEEP_OBJECT,
    "very deep list": VERY_DEEP,
    "deep list as text": json.dumps(DEEP_LIST.decode()).encode(),
    "deep object as text": json.dumps(DEEP_OBJECT.decode()).encode(),
    "very deep list as text": json.dumps(VERY_DEEP.decode()).encode(),
}

USER = {"role": "user", "content": "hi"}


def call(arguments: Any = "{}") -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": HOLE}}}}
CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
# (path, the field the hole is in, the body around it)
TEMPLATES: list[tuple[str, str, dict[str, Any]]] = [
    (CHAT, "messages.0.content", {"messages": [{"role": "user", "content": HOLE}]}),
    (CHAT, "messages.0.content.0.text", {"messages": [{"role": "user", "content": [{"type": "text", "text": HOLE}]}]}),
    (CHAT, "messages.1.tool_calls.0.function.arguments",
     {"messages": [USER, {"role": "assistant", "tool_calls": [call(HOLE)]}, {"role": "tool", "content": "1",
                                                                              "tool_call_id": "call_1"}]}),
    (CHAT, "messages.1.tool_calls.0.extra", {"messages": [USER, {"role": "assistant", "tool_calls": [
        {**call(), "extra": HOLE}]}]}),
    (CHAT, "messages.0.name", {"messages": [{**USER, "name": HOLE}]}),
    (CHAT, "chat_template_kwargs.x", {"messages": [USER], "chat_template_kwargs": {"x": HOLE}}),
    (CHAT, "tools.0.function.parameters.properties.x", {"messages": [USER], "tools": [TOOL]}),
    (CHAT, "response_format.json_schema.schema.properties.x", {"messages": [USER], "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object", "properties": {"x": HOLE}}}}}),
    (CHAT, "stop", {"messages": [USER], "stop": HOLE}),
    (CHAT, "user", {"messages": [USER], "user": HOLE}),
    (CHAT, "model", {"model": HOLE, "messages": [USER]}),
    ("/v1/completions", "prompt", {"prompt": HOLE}),
    ("/v1/completions", "prompt.1", {"prompt": ["hi", HOLE]}),
    ("/v1/completions", "stop.0", {"prompt": "hi", "stop": [HOLE]}),
    ("/v1/responses", "input", {"input": HOLE}),
    ("/v1/responses", "instructions", {"input": "hi", "instructions": HOLE}),
    ("/v1/responses", "input.0.content.0.text",
     {"input": [{"role": "user", "content": [{"type": "input_text", "text": HOLE}]}]}),
    ("/v1/responses", "input.1.arguments", {"input": [USER, {"type": "function_call", "call_id": "c", "name": "f",
                                                            "arguments": HOLE}]}),
    ("/v1/responses", "input.1.output", {"input": [USER, {"type": "function_call_output", "call_id": "c",
                                                         "output": HOLE}]}),
    ("/v1/responses", "metadata.k", {"input": "hi", "metadata": {"k": HOLE}, "store": False}),
    (MESSAGES, "messages.0.content", {"messages": [{"role": "user", "content": HOLE}]}),
    (MESSAGES, "system", {"system": HOLE, "messages": [USER]}),
    (MESSAGES, "messages.1.content.0.input.x", {"messages": [USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {"x": HOLE}}]}]}),
    (MESSAGES, "tools.0.input_schema.properties.x", {"messages": [USER], "tools": [
        {"name": "f", "input_schema": {"type": "object", "properties": {"x": HOLE}}}]}),
    (MESSAGES + "/count_tokens", "messages.0.content", {"messages": [{"role": "user", "content": HOLE}]}),
    (MESSAGES + "/count_tokens", "messages.1.content.0.input.x", {"messages": [USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {"x": HOLE}}]}]}),
    ("/tokenize", "prompt", {"prompt": HOLE}),
    ("/tokenize", "messages.0.content", {"messages": [{"role": "user", "content": HOLE}]}),
    ("/tokenize", "chat_template_kwargs.x", {"messages": [USER], "chat_template_kwargs": {"x": HOLE}}),
    ("/detokenize", "tokens.1", {"tokens": [1, HOLE]}),
]


def body_with(template: dict[str, Any], payload: bytes) -> bytes:
    # max_tokens: ignored where unknown (the server's own limit keeps the Responses API's short too)
    text = json.dumps({"model": MODEL, "max_tokens": 2, **template}).encode()
    return text.replace(json.dumps(HOLE).encode(), payload)


def error_message(path: str, answer: dict[str, Any]) -> tuple[str, str | None]:
    """(message, param) of an error in OpenAI's envelope or, on the Messages API, Anthropic's."""
    if path.startswith(MESSAGES):
        assert answer["type"] == "error", answer
        return answer["error"]["message"], None
    return answer["error"]["message"], answer["error"]["param"]


@pytest.fixture(scope="module")
def server(short_tiny_server):
    return short_tiny_server


def test_hostile_text_and_json_get_4xx_or_200_on_one_connection_with_a_bounded_log(server):
    log_before = server.log_path.stat().st_size
    failures, connections, sent = [], set(), 0
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for path, field, template in TEMPLATES:
            for name, payload in PAYLOADS.items():
                case = f"{path} {field} <- {name}"
                sent += 1
                try:
                    r = http.post(path, content=body_with(template, payload),
                                  headers={"content-type": "application/json"})
                except httpx.TransportError as exc:  # a reset connection: the next request opens another
                    failures.append(f"{case}: {exc!r}")
                    continue
                connections.add(r.extensions["network_stream"])  # one stream object per connection
                case = f"{case}: {r.status_code} {r.text[:300]}"
                if r.status_code != 200 and not 400 <= r.status_code < 500:
                    failures.append(case)
                elif name in SURROGATES:
                    if r.status_code != 400:
                        failures.append(case)
                        continue
                    message, param = error_message(path, r.json())
                    if field not in message or param not in (None, field):
                        failures.append(f"{case}: the error should name {field}")
        # The connection still serves (the tokenizer lives in the HTTP process: no worker needed).
        after = http.post("/tokenize", json={"model": MODEL, "prompt": "hi"})
        assert after.status_code == 200
        connections.add(after.extensions["network_stream"])
    assert not failures, "\n".join(failures)
    assert len(connections) == 1, "the kept-alive connection was dropped"
    grown = server.log_path.read_bytes()[log_before:]
    assert b"Traceback" not in grown, grown[-3000:]
    assert len(grown) < 400 * sent, len(grown)  # about one request line each
