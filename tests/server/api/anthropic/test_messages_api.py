"""Anthropic's Messages API end to end, driven with the official ``anthropic`` SDK (and raw httpx for
hostile bodies) against a live server on the tiny random-weight model: messages.create and
messages.stream agree, forced tool_use validates against its schema, a tool round trip, count_tokens
equals the Hugging Face tokenizer's count, x-api-key auth with key scoping, and every error in
Anthropic's shape with a 4xx."""

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import KEY_FULL, KEY_OTHER

MODEL = "tiny"
KEY = KEY_FULL  # every model; KEY_OTHER is limited to "other"
MESSAGES = [{"role": "user", "content": "Tell me about the harbour."}]
# The SDK no longer offers the sampling fields (newer Claude models dropped them); older clients send
# them and the server takes them.
GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}
TIME = {"name": "get_time", "input_schema": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}


@pytest.fixture(scope="module")
def server(keyed_server):
    return keyed_server


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(server):
    return AutoTokenizer.from_pretrained(server.model_dir)


def post(server, path: str, body: Any, key: str = KEY, **kw) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"x-api-key": key}, timeout=60, **kw)


def hf_prompt_tokens(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> int:
    """The rendered prompt's length as the model's own tokenizer counts it."""
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return len(tokenizer.encode(text, add_special_tokens=False))


# ---------------------------------------------------------------- messages.create / messages.stream


def test_create_returns_a_message(client):
    message = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=6, **GREEDY)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    assert [b.type for b in message.content] == ["text"] and message.content[0].text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == 6 and message.usage.input_tokens > 0


def test_stream_deltas_add_up_to_the_message_create_returns(client):
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, **GREEDY,
          "system": [{"type": "text", "text": "You are terse."}]}
    whole = client.messages.create(**kw)
    with client.messages.stream(**kw) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == final.content[0].text
    strip = {"id"}
    assert final.model_dump(exclude=strip) == whole.model_dump(exclude=strip)


def test_the_event_sequence_is_anthropics(server):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line and not line.startswith(":")]
    names = [line[len("event: "):] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[len("data: "):]) for line in lines if line.startswith("data: ")]
    assert [d["type"] for d in data] == names  # each event's data names it
    assert names[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    start = data[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    delta = data[-2]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5


def test_the_same_request_as_chat_completions(server, client):
    """One request path: greedy text equals the chat completions endpoint's for the same prompt."""
    message = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=10,
                                     system="Be brief.", **GREEDY)
    chat = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Be brief."}, *MESSAGES], max_tokens=10, temperature=0)
    assert message.content[0].text == chat.choices[0].message.content
    assert message.usage.input_tokens == chat.usage.prompt_tokens


def test_stop_sequence_is_reported(client):
    text = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=16, **GREEDY).content[0].text
    word = next(w for w in text.split()[1:] if text.index(w) > 0)
    message = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=16, **GREEDY,
                                     stop_sequences=[word, "zzzz-never"])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert message.content[0].text == text[: text.index(word)]
    with client.messages.stream(model=MODEL, messages=MESSAGES, max_tokens=16, **GREEDY,
                                stop_sequences=[word]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word


# ---------------------------------------------------------------- tools


def test_forced_tool_use_validates_against_the_schema(client):
    message = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=64, tools=[WEATHER, TIME],
                                     tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER["input_schema"])


def test_forced_tool_use_streams_input_json(client):
    with client.messages.stream(model=MODEL, messages=MESSAGES, max_tokens=64, tools=[WEATHER, TIME],
                                tool_choice={"type": "tool", "name": "get_time"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    (block,) = final.content
    assert block.type == "tool_use" and block.name == "get_time" and json.loads(partial) == block.input
    jsonschema.validate(block.input, TIME["input_schema"])
    assert final.stop_reason == "tool_use"


def test_any_tool_with_parallel_use_disabled_makes_one_call(client):
    message = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=96, tools=[WEATHER, TIME],
                                     tool_choice={"type": "any", "disable_parallel_tool_use": True})
    (block,) = message.content
    assert block.type == "tool_use" and block.name in ("get_weather", "get_time")
    jsonschema.validate(block.input, (WEATHER if block.name == "get_weather" else TIME)["input_schema"])


def test_structured_output_follows_the_schema(client):
    schema = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 10},
                                               "year": {"type": "integer", "minimum": 1900, "maximum": 2000}},
              "required": ["title", "year"]}
    message = client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=64,
                                     output_config={"format": {"type": "json_schema", "schema": schema}})
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


def test_tool_round_trip_with_tool_result(client, tokenizer):
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Oslo", "unit": "c"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": [{"type": "text", "text": "4 degrees"}]},
            {"type": "tool_result", "tool_use_id": "toolu_02", "content": "no such city", "is_error": True},
            {"type": "text", "text": "And now?"}]},
    ]
    message = client.messages.create(model=MODEL, messages=messages, max_tokens=4, tools=[WEATHER],
                                     tool_choice={"type": "auto"})
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4
    counted = client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
    chat_messages = [
        *MESSAGES,
        {"role": "assistant", "content": "Let me check.", "tool_calls": [{"id": "toolu_01", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}}]},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "4 degrees"},
        {"role": "tool", "tool_call_id": "toolu_02", "content": "Error: no such city"},
        {"role": "user", "content": "And now?"},
    ]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER["input_schema"],
                                               "description": WEATHER["description"]}}]
    assert counted.input_tokens == hf_prompt_tokens(tokenizer, chat_messages, tools)
    assert message.usage.input_tokens == counted.input_tokens


def test_count_tokens_equals_the_hf_tokenizer(client, tokenizer):
    counted = client.messages.count_tokens(model=MODEL, system="Answer in French.", messages=MESSAGES)
    expected = hf_prompt_tokens(tokenizer, [{"role": "system", "content": "Answer in French."}, *MESSAGES])
    assert counted.input_tokens == expected


def test_an_assistant_prefill_is_continued(client, tokenizer):
    messages = [*MESSAGES, {"role": "assistant", "content": "The harbour"}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages)
    text = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert text.endswith("The harbour")
    assert counted.input_tokens == len(tokenizer.encode(text, add_special_tokens=False))
    assert client.messages.create(model=MODEL, messages=messages, max_tokens=3).usage.output_tokens == 3


# ---------------------------------------------------------------- auth


def test_bearer_auth_works_too(server):
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0, timeout=60)
    assert bearer.messages.create(model=MODEL, messages=MESSAGES, max_tokens=2).usage.output_tokens == 2


def test_a_wrong_key_raises_authentication_error(server):
    wrong = anthropic.Anthropic(base_url=server.url, api_key="sk-wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        wrong.messages.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert exc.value.status_code == 401 and exc.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model=MODEL, messages=MESSAGES)
    r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_a_scoped_key_sees_other_models_as_absent(server):
    scoped = anthropic.Anthropic(base_url=server.url, api_key=KEY_OTHER, max_retries=0, timeout=60)
    assert scoped.messages.create(model="other", messages=MESSAGES, max_tokens=2).usage.output_tokens == 2
    for call in (scoped.messages.create, scoped.messages.count_tokens):
        with pytest.raises(anthropic.NotFoundError) as exc:
            call(model=MODEL, messages=MESSAGES, **({"max_tokens": 2} if call == scoped.messages.create else {}))
        assert exc.value.body["error"]["type"] == "not_found_error"


# ---------------------------------------------------------------- hostile input


def _body(**kw) -> dict[str, Any]:
    return {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **kw}


HOSTILE = [
    ("missing max_tokens", {"model": MODEL, "messages": MESSAGES}, 400, "max_tokens"),
    ("unknown block type", _body(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}]}]), 400, "image"),
    ("made-up block type", _body(messages=[{"role": "user", "content": [{"type": "hologram"}]}]), 400, "hologram"),
    ("tool_result from the assistant", _body(messages=[{"role": "assistant", "content": [
        {"type": "tool_result", "tool_use_id": "x", "content": "y"}]}]), 400, "tool_result"),
    ("tool_use from the user", _body(messages=[{"role": "user", "content": [
        {"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]), 400, "tool_use"),
    ("system role in messages", _body(messages=[{"role": "system", "content": "hi"}]), 400, "role"),
    ("a role that is a list", _body(messages=[{"role": ["user"], "content": [{"type": "text", "text": "x"}]}]),
     400, "role"),
    ("no messages", _body(messages=[]), 400, "messages"),
    ("content of the wrong type", _body(messages=[{"role": "user", "content": 42}]), 400, "content"),
    ("temperature above 1", _body(temperature=1.5), 400, "temperature"),
    ("max_tokens zero", _body(max_tokens=0), 400, "max_tokens"),
    ("max_tokens past the context", _body(max_tokens=10**6), 400, "context length"),
    ("too many stop sequences", _body(stop_sequences=["a", "b", "c", "d", "e"]), 400, "stop_sequences"),
    ("server tool", _body(tools=[{"type": "bash_20250124", "name": "bash"}]), 400, "bash_20250124"),
    ("tool schema not an object", _body(tools=[{"name": "f", "input_schema": {"type": "string"}}]), 400,
     "input_schema"),
    ("tool_choice names no tool", _body(tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"}), 400,
     "nope"),
    ("tool_choice any without tools", _body(tool_choice={"type": "any"}), 400, "needs tools"),
    ("unknown tool_choice", _body(tools=[WEATHER], tool_choice={"type": "sometimes"}), 400, "tool_choice"),
    ("unknown model", _body(model="claude-9-opus"), 404, "claude-9-opus"),
    ("oversized prompt", _body(messages=[{"role": "user", "content": "a" * 1_000_001}]), 400, "too long"),
]


@pytest.mark.parametrize(("name", "body", "status", "words"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_get_anthropic_errors(server, name, body, status, words):
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        if path.endswith("count_tokens") and words in ("max_tokens", "temperature", "context length",
                                                        "stop_sequences"):
            continue  # sampling fields: count_tokens ignores them
        r = post(server, path, body)
        assert r.status_code == status, (path, r.text)
        error = r.json()
        assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
        assert error["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
        assert words in error["error"]["message"], error
        assert error["request_id"] == r.headers["x-request-id"]


def test_malformed_json_oversized_body_and_wrong_method(server):
    r = httpx.post(f"{server.url}/v1/messages", content=b"{not json", timeout=30,
                   headers={"x-api-key": KEY, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    big = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "a" * (9 * 1024 * 1024)}]}
    r = post(server, "/v1/messages", big)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.get(f"{server.url}/v1/messages", headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 405 and r.json()["type"] == "error"
    # Other paths keep OpenAI's envelope.
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["code"] == "missing_required_parameter"


def test_the_sdk_raises_its_typed_errors_and_the_server_lives_on(server, client):
    with pytest.raises(anthropic.BadRequestError) as exc:
        client.messages.create(model=MODEL, messages=[{"role": "user", "content": [{"type": "document"}]}],
                               max_tokens=4)
    assert exc.value.body["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"
    assert client.messages.create(model=MODEL, messages=MESSAGES, max_tokens=2).usage.output_tokens == 2
