"""Anthropic's framing of a stream: ``event:`` lines that the SDK reads, and an error after the first
event as an ``error`` event in Anthropic's shape, with the request aborted and logged either way."""

import asyncio
import json
from types import SimpleNamespace

from xinserve.server.api.anthropic.sse import event_stream_response
from xinserve.server.errors import APIError


class _Gen:
    request_id = "msg_1"
    worker = SimpleNamespace(model_name="m", label="cpu")
    prompt_tokens, completion_tokens = 3, 1
    lora_name = None  # the base model (no LoRA adapter)

    def __init__(self) -> None:
        self.aborted = self.observed = False

    def abort(self) -> None:
        self.aborted = True

    def observe(self, metrics, end) -> None:
        self.observed = True


def _run(events) -> tuple[list[tuple[str, dict]], _Gen, SimpleNamespace]:
    gen, request = _Gen(), SimpleNamespace(state=SimpleNamespace())
    response = event_stream_response(request, gen, events, metrics=None)

    async def body() -> bytes:
        return b"".join([chunk async for chunk in response.body_iterator])

    frames = []
    for frame in asyncio.run(body()).decode().split("\n\n"):
        if frame:
            event, data = frame.split("\n")
            frames.append((event.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return frames, gen, request


def test_each_event_is_named_by_its_type_and_nothing_follows_the_last():
    async def events():
        yield {"type": "message_start", "message": {}}
        yield {"type": "message_stop"}

    frames, gen, request = _run(events())
    assert frames == [("message_start", {"type": "message_start", "message": {}}),
                      ("message_stop", {"type": "message_stop"})]
    assert gen.aborted and gen.observed and request.state.log["outcome"] == "ok"


def test_an_error_mid_stream_is_an_error_event():
    async def events():
        yield {"type": "message_start", "message": {}}
        raise APIError(503, "the worker died")

    frames, gen, request = _run(events())
    assert frames[-1] == ("error", {"type": "error", "error": {"type": "overloaded_error",
                                                                "message": "the worker died"}})
    assert gen.aborted and request.state.log["outcome"] == "error 503"


def test_an_unexpected_failure_mid_stream_is_an_api_error_event():
    async def events():
        yield {"type": "ping"}
        raise RuntimeError("boom")

    frames, _, request = _run(events())
    assert frames[-1][0] == "error" and frames[-1][1]["error"]["type"] == "api_error"
    assert "boom" not in frames[-1][1]["error"]["message"] and request.state.log["outcome"] == "error 500"
