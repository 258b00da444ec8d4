"""Anthropic's server-sent events: ``event: <type>`` then ``data: {json}`` per event, no ``[DONE]``.

Anthropic's SDKs skip events without an ``event:`` line, so OpenAI's ``data:``-only framing
(``server/routes/common.sse_response``) would read as an empty stream. Otherwise the same contract:
an error after the first event is an ``error`` event; the request is aborted in its worker when the
stream ends however it ends; one log line and one metrics observation.
"""

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from sse_starlette.sse import EventSourceResponse

from server.anthropic.errors import api_error_body
from server.errors import APIError
from server.routes.common import _EventStream, dumps, log_fields

logger = logging.getLogger("xinserve.server")


def event_frame(event: dict[str, Any]) -> bytes:
    """One event; every Anthropic event's data names its own type, which is also the event's name."""
    return b"event: " + event["type"].encode() + b"\ndata: " + dumps(event).encode() + b"\n\n"


def event_stream_response(
    request: Request, gen: Any, events: AsyncIterator[dict[str, Any]], metrics: Any
) -> EventSourceResponse:
    """``gen``: a ``GenerationGroup``; ``events``: the Messages API's event dicts."""

    async def frames() -> AsyncIterator[bytes]:
        status = "disconnected"
        try:
            async for event in events:
                yield event_frame(event)
            status = "ok"
        except APIError as exc:
            status = f"error {exc.status}"
            yield event_frame(api_error_body(exc))
        except Exception:
            status = "error 500"
            logger.exception("request %s failed mid-stream", gen.request_id)
            yield event_frame(api_error_body(APIError(500, f"Internal error in request {gen.request_id}.")))
        finally:
            gen.abort()
            log_fields(request, gen, status)
            gen.observe(metrics, time.perf_counter())

    return _EventStream(frames(), sep="\n", ping=15, headers={"Cache-Control": "no-cache"})
