"""Structured output, tool calls, logit_bias and echoed prompt log-probs through the openai SDK against
a live server on the embedded random-weight tiny model; bodies and chunks checked against OpenAI's
schemas. The model is random, so schemas bound strings and arrays (maxLength, maxItems, enums)."""

import json
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.server.conftest import EMBEDDED_KEY

MODEL = "xinserve-tiny"
MESSAGES = [{"role": "user", "content": "Describe a book."}]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
NESTED = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 16},
        "genre": {"enum": ["novel", "poetry", "history"]},
        "authors": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                             "born": {"type": "integer", "minimum": 1800, "maximum": 2000}},
            "required": ["name", "born"]}},
        "tags": {"type": "array", "items": {"enum": ["old", "new", "rare"]}, "maxItems": 3},
    },
    "required": ["title", "genre", "authors", "tags"],
}


class Book(BaseModel):
    title: str = Field(max_length=20)
    genre: Literal["novel", "poetry", "history"]
    year: int = Field(ge=1900, le=2100)
    tags: list[Annotated[str, Field(max_length=8)]] = Field(max_length=3)


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=EMBEDDED_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {EMBEDDED_KEY}"}, timeout=120) as c:
        yield c


def stream_chunks(http, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        events = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_parse_with_a_pydantic_model_greedy_and_seeded(client):
    for kwargs in ({"temperature": 0}, *({"temperature": 1.0, "seed": s} for s in (1, 2, 3))):
        completion = client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, response_format=Book, max_tokens=200, **kwargs)
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", kwargs
        assert isinstance(choice.message.parsed, Book)
        assert choice.message.refusal is None
        assert Book.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object(http, schemas):
    body = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": MESSAGES, "response_format": {"type": "json_object"}, "max_tokens": 80,
        "temperature": 0}).json()
    schemas.validate("CreateChatCompletionResponse", body)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(body["choices"][0]["message"]["content"]), dict)


def test_nested_schema_whole_and_streamed(http, schemas):
    request = {"model": MODEL, "messages": MESSAGES, "max_tokens": 200, "n": 2, "temperature": 1.0, "seed": 7,
               "response_format": {"type": "json_schema", "json_schema": {"name": "book", "schema": NESTED,
                                                                           "strict": True}}}
    body = http.post("/v1/chat/completions", json=request).json()
    schemas.validate("CreateChatCompletionResponse", body)
    contents = [c["message"]["content"] for c in body["choices"]]
    for choice, content in zip(body["choices"], contents):
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(content), NESTED)
    streamed = ["", ""]
    for chunk in stream_chunks(http, "/v1/chat/completions", request):
        schemas.validate("CreateChatCompletionStreamResponse", chunk)
        for choice in chunk["choices"]:
            streamed[choice["index"]] += choice["delta"].get("content") or ""
    assert streamed == contents


def _validate_calls(calls: list[dict], names: set[str]) -> None:
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMETERS[call["function"]["name"]])


def _assembled(chunks: list[dict]) -> list[dict]:
    """Streamed tool-call deltas put together as OpenAI's clients do."""
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk["choices"][0]["delta"].get("tool_calls") or [] if chunk["choices"] else []:
            call = calls.setdefault(delta["index"], {"names": 0, "name": "", "arguments": ""})
            if delta.get("function", {}).get("name"):
                call["names"] += 1
                call["name"] = delta["function"]["name"]
            call["arguments"] += delta.get("function", {}).get("arguments") or ""
    assert all(c["names"] == 1 for c in calls.values())  # the name once, the arguments in pieces
    return [{"name": calls[i]["name"], "arguments": calls[i]["arguments"]} for i in sorted(calls)]


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_weather"}}, "required",
], ids=["named", "required"])
def test_forced_tool_calls_whole_and_streamed(http, schemas, tool_choice):
    request = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": tool_choice,
               "max_tokens": 120, "temperature": 1.0, "seed": 5}
    body = http.post("/v1/chat/completions", json=request).json()
    schemas.validate("CreateChatCompletionResponse", body)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    _validate_calls(calls, {"get_weather"} if isinstance(tool_choice, dict) else set(PARAMETERS))
    chunks = stream_chunks(http, "/v1/chat/completions", request)
    for chunk in chunks:
        schemas.validate("CreateChatCompletionStreamResponse", chunk)
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["tool_calls"]
    assert _assembled(chunks) == [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                                  for c in calls]


def test_required_without_parallel_calls_makes_one(client):
    completion = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        max_tokens=80, temperature=0)
    calls = completion.choices[0].message.tool_calls
    assert len(calls) == 1
    _validate_calls([c.model_dump() for c in calls], set(PARAMETERS))


def test_tool_messages_go_through_the_template(client):
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    completion = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4)
    # tool_choice auto on a model whose template shows no call syntax: plain content.
    assert completion.choices[0].message.tool_calls is None and completion.usage.completion_tokens == 4


def test_logit_bias_forces_and_forbids(http, server):
    tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
    river = tokenizer.encode(" river", add_special_tokens=False)
    assert len(river) == 1
    base = {"model": MODEL, "prompt": "The harbour", "max_tokens": 4, "temperature": 0}
    forced = http.post("/v1/completions", json={**base, "logit_bias": {str(river[0]): 100}}).json()
    assert forced["choices"][0]["text"] == " river" * 4
    first = http.post("/v1/completions", json={**base, "max_tokens": 1}).json()["choices"][0]["text"]
    (first_id,) = tokenizer.encode(first, add_special_tokens=False)
    banned = http.post("/v1/completions", json={**base, "max_tokens": 1, "logit_bias": {str(first_id): -100}})
    assert banned.json()["choices"][0]["text"] != first
    for bias, param in (({"5": 101}, "logit_bias"), ({"x": 1}, "logit_bias"), ({"999999": 1}, "logit_bias")):
        r = http.post("/v1/completions", json={**base, "logit_bias": bias})
        assert r.status_code == 400, bias
        assert r.json()["error"]["param"] == param


def _schema_view(block: dict) -> dict:
    """OpenAI's API sends null for the first echoed token's log-probs, which its published schema
    (numbers only) leaves out; the rest is checked as it is."""
    return {**block, "token_logprobs": [0.0 if v is None else v for v in block["token_logprobs"]],
            "top_logprobs": [{} if v is None else v for v in block["top_logprobs"]]}


def test_echo_with_logprobs_equals_transformers(http, server, schemas):
    prompt = "The river begins as a spring"
    request = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0}
    body = http.post("/v1/completions", json=request).json()
    choice = body["choices"][0]
    schemas.validate("CreateCompletionResponse", {**body, "choices": [{**choice,
                                                                       "logprobs": _schema_view(choice["logprobs"])}]})
    lp = choice["logprobs"]
    ids = AutoTokenizer.from_pretrained(server.model_dir).encode(prompt)
    n = len(ids)
    hf = AutoModelForCausalLM.from_pretrained(server.model_dir, dtype=torch.float32)
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:n] == pytest.approx([expected[i - 1, ids[i]].item() for i in range(1, n)],
                                                      abs=1e-4)
    assert len(lp["tokens"]) == n + 3 and choice["text"].startswith(prompt)
    # Offsets index the returned text (the BOS the tokenizer added is not in it).
    assert all(choice["text"].startswith(t, o) for t, o in zip(lp["tokens"][1:], lp["text_offset"][1:]))
    assert lp["text_offset"][n] == len(prompt)
    first = stream_chunks(http, "/v1/completions", request)[0]["choices"][0]
    assert first["logprobs"]["token_logprobs"][:n] == lp["token_logprobs"][:n]


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
]


@pytest.mark.parametrize(("override", "param"), BAD, ids=[p for _, p in BAD])
def test_invalid_structured_requests_are_400(http, schemas, override, param):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **override})
    assert r.status_code == 400, r.text
    schemas.validate("ErrorResponse", r.json())
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(("override", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"code": {"type": "string", "pattern": "c{8000}"}}}}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "(c{100}){80}"}}}}}],
      "tool_choice": "required"}, "tools.function.parameters"),
], ids=["response_format", "tools"])
def test_costly_schema_is_400_naming_the_bound(http, schemas, override, param):
    # Refused by the static bound before any compile (c{8000} once took 9 s in this check).
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **override})
    assert r.status_code == 400, r.text
    schemas.validate("ErrorResponse", r.json())
    error = r.json()["error"]
    assert error["param"] == param and "patterns repeat to 8000 atoms" in error["message"]
