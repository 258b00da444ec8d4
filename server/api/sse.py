"""``SSEResponse``: a lean ASGI response for server-sent events, one body message per chunk.

It sends what sse-starlette's ``EventSourceResponse`` sent for our streams, byte for byte (the same
start message, a ``: ping - <UTC time>`` comment every ``ping_s`` seconds, the chunks as given, an
empty last message), with less work per chunk: no task group of four tasks per stream, no lock, no
per-chunk encoding check or debug log, no cancel scope per send. A disconnect (``http.disconnect``
from ``receive``) cancels the streaming task, so the chunk iterator's ``finally`` runs (it aborts the
request in the worker); so does a failing send, after which the error propagates.

Measured with ``benchmarks/server_path_cpu.py`` (CPU of the HTTP process per streamed token).
"""

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import Any

from starlette.responses import Response

# The scope key under which ``DirectSendMiddleware`` leaves the server's own ``send``.
DIRECT_SEND = "xinserve.direct_send"
HEADERS = [(b"cache-control", b"no-cache"), (b"connection", b"keep-alive"), (b"x-accel-buffering", b"no"),
           (b"content-type", b"text/event-stream; charset=utf-8")]


class SSEResponse(Response):
    """``body_iterator``: the stream's chunks, each already framed (``data: ...\\n\\n``).

    A ``Response`` (FastAPI sends a returned Response as it is), built without its body machinery."""

    def __init__(self, body_iterator: AsyncIterator[bytes], ping_s: float = 15.0) -> None:
        self.body_iterator = body_iterator
        self.ping_s = ping_s
        self.status_code = 200
        self.background = None  # FastAPI may set its (empty) background tasks here
        self.raw_headers = list(HEADERS)
        self.push: Any = None  # a ``StreamPush`` (server/api/stream_push.py) to attach to the body's send

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        # The start goes through every middleware (status and headers for logs, metrics, errors); the
        # body messages, which they all pass through untouched, straight to the server when it can.
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        send = scope.get(DIRECT_SEND, send)
        if self.push is not None:
            self.push.attach(send)
        stream = asyncio.ensure_future(self._stream(send))
        helpers = [asyncio.ensure_future(_wait_disconnect(receive))]
        if self.ping_s > 0:
            helpers.append(asyncio.ensure_future(self._ping(send)))
        try:
            await asyncio.wait([stream, helpers[0]], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (*helpers, stream):
                task.cancel()
            # The stream's cleanup (the iterator's ``finally``) is done before the response returns.
            await asyncio.gather(stream, *helpers, return_exceptions=True)
            if self.push is not None:
                self.push.detach()
        if not stream.cancelled() and stream.exception() is not None:
            raise stream.exception()
        if self.background is not None:
            await self.background()

    async def _stream(self, send: Any) -> None:
        chunks = self.body_iterator
        try:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                await aclose()  # after a failed send: the iterator's ``finally`` runs now
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _ping(self, send: Any) -> None:
        # Each ASGI send writes one whole message, so a ping never lands inside a chunk.
        while True:
            await asyncio.sleep(self.ping_s)
            comment = f": ping - {datetime.now(timezone.utc)}\n\n".encode()
            await send({"type": "http.response.body", "body": comment, "more_body": True})


async def _wait_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class DirectSendMiddleware:
    """The outermost of the app's own middleware: leaves the server's ``send`` in the scope, so that a
    stream's body messages skip the send wrappers of the layers inside (the request log's, Prometheus's,
    Starlette's exception handlers'), a coroutine call each per chunk. Those read only the start
    message, which still goes through them all (``tests/server/api/test_sse_response.py`` holds the app to
    middleware of that kind)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        scope[DIRECT_SEND] = send
        await self.app(scope, receive, send)
