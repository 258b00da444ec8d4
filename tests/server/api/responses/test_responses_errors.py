"""The Responses API's errors in its own shape, through the in-process app and a stand-in worker
(tests/server/stand_in_worker.py): a worker lost mid-stream ends the stream with Responses' typed
``error`` and ``response.failed`` events (numbered on, no ``data: [DONE]``, which is chat's), a 400
names Responses' fields (never chat's ``messages`` or ``max_completion_tokens``), ids read ``resp_…``."""

import asyncio
import json

import httpx
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from tests.server.stand_in_worker import StandInWorker, auth, make_app
from xinserve.server.worker.messages import RequestError

EVENTS = TypeAdapter(ResponseStreamEvent)
BODY = {"model": "m", "input": "hello there", "max_output_tokens": 20}


def post(app, body: dict) -> tuple[int, list[str] | dict]:
    """The status and the stream's ``data:`` payloads, or the JSON body when not streamed."""
    async def go():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=auth("team-a")) as c:
            r = await c.post("/v1/responses", json=body)
        if body.get("stream") and r.status_code == 200:
            return r.status_code, [line[5:].strip() for line in r.text.splitlines() if line.startswith("data:")]
        return r.status_code, r.json()

    return asyncio.run(go())


def test_a_worker_lost_mid_stream_ends_with_error_and_response_failed_events(tiny_tokenizer, schemas):
    lost = RequestError("worker cpu#7 of m is unresponsive", unavailable=True, retryable=True)
    app = make_app(tiny_tokenizer, StandInWorker(2, lost, end_after_s=0.05))
    status, data = post(app, {**BODY, "stream": True})
    assert status == 200
    assert "[DONE]" not in data
    events = [json.loads(d) for d in data]
    for event in events:
        schemas.validate("ResponseStreamEvent", event)
        EVENTS.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created"
    assert "response.output_text.delta" in [e["type"] for e in events]  # it failed after frames went out
    error, failed = events[-2:]
    assert error["type"] == "error" and "unresponsive" in error["message"]
    assert failed["type"] == "response.failed"
    response = failed["response"]
    assert response["status"] == "failed" and response["id"] == events[0]["response"]["id"]
    assert response["error"]["code"] == "server_error" and "unresponsive" in response["error"]["message"]
    schemas.validate("Response", response)


@pytest.mark.parametrize(("body", "param"), [
    ({"max_output_tokens": 5000}, "max_output_tokens"),  # more than the context leaves
    ({"max_output_tokens": 0}, "max_output_tokens"),  # the engine's range (SamplingParams.validate)
    ({"top_p": 0}, "top_p"),  # OpenAI documents 0..1, the engine samples from (0, 1]
    ({"input": []}, "input"),
    ({"input": [{"role": "user", "content": "x" * 1_000_001}]}, "input"),  # limits.max_prompt_chars
    ({"text": {"format": {"type": "json_object"}}, "tool_choice": "required",
      "tools": [{"type": "function", "name": "f"}]}, "text.format"),
])
def test_a_400_names_the_responses_field(tiny_tokenizer, body, param):
    app = make_app(tiny_tokenizer, StandInWorker(2, "stop"))
    status, answer = post(app, {**BODY, **body})
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == param
    assert not any(chat in error["message"] for chat in ("messages", "max_completion_tokens", "response_format"))


def test_response_ids_read_resp_underscore(tiny_tokenizer):
    app = make_app(tiny_tokenizer, StandInWorker(2, "stop"))
    status, answer = post(app, BODY)
    assert status == 200 and answer["id"].startswith("resp_"), answer
    status, data = post(app, {**BODY, "stream": True})
    created = json.loads(data[0])
    assert created["type"] == "response.created" and created["response"]["id"].startswith("resp_")
