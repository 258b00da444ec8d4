"""Anthropic's server-sent events: ``event: <type>`` then ``data: {json}`` per event, no ``[DONE]``.

Anthropic's SDKs skip events without an ``event:`` line, so OpenAI's ``data:``-only framing
(``server/api/common.sse_response``) would read as an empty stream. Otherwise the same contract
(``server/api/common.event_stream``): an error after the first event is an ``error`` event; the
request is aborted in its worker when the stream ends however it ends; one log line and one metrics
observation.
"""

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from xinserve.server.api.anthropic.errors import api_error_body
from xinserve.server.api.common import dumps, event_stream
from xinserve.server.api.sse import SSEResponse


def event_frame(event: dict[str, Any]) -> bytes:
    """One event; every Anthropic event's data names its own type, which is also the event's name."""
    return b"event: " + event["type"].encode() + b"\ndata: " + dumps(event).encode() + b"\n\n"


def event_stream_response(
    request: Request, gen: Any, events: AsyncIterator[dict[str, Any]], metrics: Any
) -> SSEResponse:
    """``gen``: a ``GenerationGroup``; ``events``: the Messages API's event dicts."""
    return event_stream(request, gen, events, metrics, frame=event_frame, error_body=api_error_body)
