"""Reasoning split from the answer in chat completions (``reasoning_content``), whole and streamed, with
tool calls and structured output, on a tiny model scripted to think (tests/server/thinking_model.py)."""

import json

import httpx
import pytest

from tests.server.thinking_model import ANSWER, KEYS, REASONING

MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def http(thinking_server):
    with httpx.Client(base_url=thinking_server.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEYS[0]}"}) as client:
        yield client


def chat(http, **body) -> dict:
    r = http.post("/v1/chat/completions", json={"model": "thinker", "messages": MESSAGES, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(http, **body) -> list[dict]:
    body = {"model": "thinker", "messages": MESSAGES, "temperature": 0, "stream": True, **body}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def joined(chunks: list[dict], field: str) -> str:
    return "".join(c["choices"][0]["delta"].get(field) or "" for c in chunks if c["choices"])


def test_reasoning_is_split_from_the_answer(http, schemas):
    body = chat(http, max_tokens=6)  # <think> river stars</think> The light
    schemas.validate("CreateChatCompletionResponse", body)
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == REASONING and message["content"] == ANSWER
    assert body["choices"][0]["finish_reason"] == "length"


def test_streamed_reasoning_deltas(http, schemas):
    chunks = stream(http, max_tokens=6)
    for chunk in chunks:
        schemas.validate("CreateChatCompletionStreamResponse", chunk)
    assert joined(chunks, "reasoning_content") == REASONING and joined(chunks, "content") == ANSWER
    assert all("think>" not in json.dumps(c) for c in chunks)  # tags never reach the client


def test_tool_calls_are_read_after_the_reasoning(http, schemas):
    body = chat(http, tools=TOOLS)
    schemas.validate("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["reasoning_content"] == REASONING and choice["message"]["content"] == ANSWER.strip()
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}

    chunks = stream(http, tools=TOOLS)
    for chunk in chunks:
        schemas.validate("CreateChatCompletionStreamResponse", chunk)
    assert joined(chunks, "reasoning_content") == REASONING and joined(chunks, "content") == ANSWER
    calls = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_enable_thinking_false_means_no_reasoning(http):
    body = chat(http, max_tokens=2, chat_template_kwargs={"enable_thinking": False})
    message = body["choices"][0]["message"]
    assert "reasoning_content" not in message and message["content"] == ANSWER


def test_reasoning_opened_by_the_prompt(http):
    """A template that ends the prompt with <think> (Qwen3 thinking-2507, GLM-4.7): the output starts
    inside the reasoning and holds only </think>."""
    body = chat(http, max_tokens=5, chat_template_kwargs={"think_open": True})
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == REASONING and message["content"] == ANSWER


def test_structured_output_starts_after_the_reasoning(http):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
    body = chat(http, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": schema}})
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] == REASONING  # free reasoning, exactly the unconstrained one
    assert set(json.loads(message["content"])) == {"city"}
