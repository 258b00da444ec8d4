"""OpenAI's Responses API through the openai SDK against a live server of the scripted thinking model
(tests/server/thinking_model.py): bodies and every stream event validated with the SDK's own typed
models of the API (openai.types.responses), tool round trips, stored conversations, hostile input."""

import json

import httpx
import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server.thinking_model import ANSWER, KEYS, REASONING

MODEL = "thinker"
QUESTION = "What is the weather in Paris?"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather of a city", "strict": False,
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                         "required": ["city"]}}]
EVENTS = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def client(thinking_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key=KEYS[0], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(thinking_server):
    with httpx.Client(base_url=thinking_server.url, timeout=120,
                      headers={"Authorization": f"Bearer {KEYS[0]}"}) as c:
        yield c


def raw(http, schemas, **body) -> dict:
    r = http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())  # the SDK's typed model, strictly
    schemas.validate("Response", r.json())  # OpenAI's published schema
    return r.json()


def raw_events(http, schemas, **body) -> list[dict]:
    body = {"model": MODEL, "input": QUESTION, "temperature": 0, "stream": True, **body}
    with http.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200, r.read()
        data = [line[5:].strip() for line in r.iter_lines() if line.startswith("data:")]
    assert "[DONE]" not in data  # not part of the Responses protocol: the stream ends at its last event
    events = [json.loads(d) for d in data]
    for event in events:
        schemas.validate("ResponseStreamEvent", event)
        EVENTS.validate_python(event)
    return events


def test_bodies_and_events_match_the_published_schemas(http, schemas):
    raw(http, schemas, max_output_tokens=6)
    raw(http, schemas, tools=TOOLS)
    events = raw_events(http, schemas, tools=TOOLS)
    assert events[-1]["type"] == "response.completed"
    schemas.validate("Response", events[-1]["response"])
    assert raw_events(http, schemas, max_output_tokens=3)[-1]["type"] == "response.incomplete"


def test_create_returns_reasoning_and_message_items(client, http, schemas):
    body = raw(http, schemas, max_output_tokens=6)
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]
    assert body["output"][0]["content"][0]["text"] == REASONING
    response = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=6)
    assert response.output_text == ANSWER
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    usage = response.usage
    assert usage.output_tokens == 6 and usage.output_tokens_details.reasoning_tokens == 4
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_stream_events_in_the_documented_order(client):
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=6) as stream:
        events = list(stream)
    final = events[-1].response  # cut by max_output_tokens: "response.incomplete" (the helper wants completed)
    for event in events:
        EVENTS.validate_python(event.model_dump(exclude_unset=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    message = kinds.index("response.output_text.delta")
    assert kinds[message - 2: message] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == ANSWER
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == REASONING
    assert final.output_text == ANSWER


def test_tool_round_trip_with_previous_response_id(client):
    first = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert first.status == "completed" and first.output_text == ANSWER
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=TOOLS, temperature=0, max_output_tokens=6,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}],
    )
    # The stored conversation (question, the call) plus the tool's output made the prompt.
    assert second.usage.input_tokens > first.usage.input_tokens + 5
    assert client.responses.retrieve(second.id).id == second.id
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_tool_round_trip_stateless(client):
    """The whole history as input items (what agents send without previous_response_id), streamed."""
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "21 degrees"}]
    with client.responses.stream(model=MODEL, input=items, tools=TOOLS, temperature=0, store=False) as stream:
        events = list(stream)
        final = stream.get_final_response()
    for event in events:
        EVENTS.validate_python(event.model_dump(exclude_unset=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    (call,) = [item for item in final.output if item.type == "function_call"]
    assert json.loads(call.arguments) == {"city": "Paris"}
    with pytest.raises(openai.NotFoundError):  # store=False keeps nothing
        client.responses.retrieve(final.id)


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"],
              "additionalProperties": False}
    response = client.responses.create(
        model=MODEL, input=QUESTION, temperature=0, max_output_tokens=60,
        text={"format": {"type": "json_schema", "name": "weather", "schema": schema, "strict": True}})
    assert set(json.loads(response.output_text)) == {"city"}  # the grammar began after the reasoning
    assert response.output[0].type == "reasoning"


def test_reasoning_effort_reaches_the_template(client):
    plain = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1)
    effort = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=1, reasoning={"effort": "high"})
    assert effort.usage.input_tokens > plain.usage.input_tokens  # the test template writes "effort high"


def test_a_response_belongs_to_its_key(client, thinking_server):
    first = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=2)
    other = openai.OpenAI(base_url=f"{thinking_server.url}/v1", api_key=KEYS[1], max_retries=0, timeout=120)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        other.responses.create(model=MODEL, input="more", previous_response_id=first.id)
    assert err.value.body["param"] == "previous_response_id"
    assert client.responses.retrieve(first.id).id == first.id


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": [{"type": "computer_call", "id": "x"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, 400,
     "input[0].content"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0]"),
    ({"input": "hi", "previous_response_id": "resp-nope"}, 404, "previous_response_id"),
    ({"input": "x" * 1_000_001}, 400, "input"),
    ({"input": "hi", "temperature": "hot"}, 400, "temperature"),
    ({"input": "hi", "model": "nope"}, 404, "model"),
    ({"input": 5}, 400, "input"),
    ({"input": "hi", "background": True}, 400, "background"),
])
def test_hostile_input_gets_the_error_envelope(http, body, status, param):
    r = http.post("/v1/responses", json={"model": MODEL, **body})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_forced_tool_choice(client, tool_choice):
    """A forced call is a grammar: it starts after the reasoning, and its arguments match the schema."""
    response = client.responses.create(model=MODEL, input=QUESTION, tools=TOOLS, tool_choice=tool_choice,
                                       temperature=0, max_output_tokens=80)
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    call = response.output[1]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
