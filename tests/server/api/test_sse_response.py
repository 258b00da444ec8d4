"""The lean SSE response: the bytes sse-starlette sent, a disconnect that ends the stream (and so aborts
the request), pings, a failed send that closes the stream, and body messages that skip the middleware
send wrappers while the start message goes through them all."""

import asyncio
import re
import sys

import pytest
from fastapi import Request
from prometheus_fastapi_instrumentator.middleware import PrometheusInstrumentatorMiddleware
from sse_starlette.sse import EventSourceResponse

from xinserve.server.api.anthropic import AnthropicErrorMiddleware
from xinserve.server.api.sse import DirectSendMiddleware, SSEResponse
from xinserve.server.app import create_app
from xinserve.server.config import parse_config
from xinserve.server.errors import InternalErrorMiddleware
from xinserve.server.http.body_limit import BodyLimitMiddleware
from xinserve.server.http.drain import DrainMiddleware
from xinserve.server.http.key_usage import KeyUsageMiddleware
from xinserve.server.http.request_log import RequestLogMiddleware

CHUNKS = [b'data: {"a":1}\n\n', b'data: {"b":"\\u00e9 \\n"}\n\ndata: {"c":3}\n\n', b"data: [DONE]\n\n"]


async def _chunks(items, closed: list[str]):
    try:
        for item in items:
            yield item
    finally:
        closed.append("closed")


async def _never_disconnects():
    await asyncio.Event().wait()


def _sent(response, receive=_never_disconnects, send_error: int | None = None) -> list[dict]:
    sent: list[dict] = []

    async def send(message):
        if send_error is not None and len(sent) == send_error:
            raise OSError("the client went away")
        sent.append(message)

    asyncio.run(response({"type": "http", "method": "POST"}, receive, send))
    return sent


def test_the_messages_are_byte_identical_to_sse_starlettes():
    ours = _sent(SSEResponse(_chunks(CHUNKS, [])))
    theirs = _sent(EventSourceResponse(_chunks(CHUNKS, []), sep="\n", ping=15, headers={"Cache-Control": "no-cache"}))
    assert ours == theirs
    assert [m.get("body") for m in ours[1:]] == [*CHUNKS, b""]


def test_a_disconnect_cancels_the_stream_and_runs_its_cleanup():
    closed: list[str] = []
    first_sent = asyncio.Event()

    async def stalls():
        try:
            yield CHUNKS[0]
            await asyncio.Event().wait()  # the next token never comes
        finally:
            closed.append("aborted")  # where event_stream aborts the request in the worker

    async def receive():
        await first_sent.wait()
        return {"type": "http.disconnect"}

    response = SSEResponse(stalls())
    sent: list[dict] = []

    async def send(message):
        sent.append(message)
        if message.get("body"):
            first_sent.set()

    asyncio.run(response({"type": "http", "method": "POST"}, receive, send))
    assert closed == ["aborted"]
    assert [m.get("body") for m in sent[1:]] == [CHUNKS[0]]  # no end of body: the client is gone


def test_pings_are_sse_comments_between_chunks():
    pinged = asyncio.Event()

    async def slow():
        yield CHUNKS[0]
        await pinged.wait()
        yield CHUNKS[1]

    sent: list[dict] = []

    async def send(message):
        sent.append(message)
        if message.get("body", b"").startswith(b":"):
            pinged.set()

    asyncio.run(SSEResponse(slow(), ping_s=0.001)({"type": "http"}, _never_disconnects, send))
    bodies = [m["body"] for m in sent[1:]]
    assert bodies[0] == CHUNKS[0] and bodies[-2:] == [CHUNKS[1], b""]
    pings = bodies[1:-2]
    assert pings and all(re.fullmatch(rb": ping - \d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+\+00:00\n\n", p) for p in pings)


def test_a_failed_send_closes_the_stream_and_raises():
    closed: list[str] = []
    with pytest.raises(OSError, match="went away"):
        _sent(SSEResponse(_chunks(CHUNKS, closed)), send_error=2)  # the start and one chunk went
    assert closed == ["closed"]


def _app():
    return create_app(parse_config({"models": [{"name": "m", "path": "/nonexistent", "workers": ["cpu"]}]}))


def test_every_middleware_inside_the_direct_send_reads_only_the_start_message():
    # A middleware that changes or counts body messages (gzip, a body logger) must not sit inside
    # DirectSendMiddleware: the stream's chunks would skip it. Adding one means revisiting server/api/sse.py.
    stack = [m.cls for m in _app().user_middleware]
    assert stack[0] is DirectSendMiddleware
    assert set(stack[1:]) == {AnthropicErrorMiddleware, InternalErrorMiddleware, RequestLogMiddleware,
                              KeyUsageMiddleware, DrainMiddleware, BodyLimitMiddleware,
                              PrometheusInstrumentatorMiddleware}


def test_stream_chunks_skip_the_send_wrappers_but_the_start_goes_through_them():
    app = _app()

    async def endpoint(request: Request) -> SSEResponse:
        return SSEResponse(_chunks(CHUNKS, []))

    app.add_api_route("/stream", endpoint, methods=["POST"])
    wrapper_calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "send_wrapper":  # the request log's and Prometheus's
            wrapper_calls.append(frame.f_code.co_qualname)

    sent: list[dict] = []

    requests = [{"type": "http.request", "body": b"", "more_body": False}]

    async def receive():
        return requests.pop() if requests else await _never_disconnects()

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/stream", "raw_path": b"/stream", "query_string": b"", "root_path": "",
             "headers": [], "client": ("127.0.0.1", 1), "server": ("test", 80)}
    sys.setprofile(profile)
    try:
        asyncio.run(app(scope, receive, send))
    finally:
        sys.setprofile(None)
    assert sent[0]["status"] == 200 and any(k == b"x-request-id" for k, _ in sent[0]["headers"])
    assert [m.get("body") for m in sent[1:]] == [*CHUNKS, b""]
    # Each wrapper saw the start message only: once per wrapper, not once per chunk.
    assert sorted(wrapper_calls) == sorted(set(wrapper_calls)) and len(wrapper_calls) == 2
