"""Request bodies over ``limits.max_body_bytes`` get a 413 before any of them is parsed.

A pure ASGI middleware: a declared ``Content-Length`` over the limit is refused at once, without
reading the body; a body without one (chunked) is read up to the limit here, then handed to the
app whole, so the app never sees a byte past the limit and never starts on a request it would
have to abandon. The 413 says ``Connection: close``: the rest of the upload is not worth reading.

The whole body in hand, its JSON is held to ``server/http/json_body.py``'s bounds (nesting depth, valid
Unicode text) before any handler parses it: a 400 for every endpoint from this one place.
"""

from typing import Any

from xinserve.server.errors import APIError, error_response
from xinserve.server.http.asgi import HTTPMiddleware
from xinserve.server.http.json_body import check_json_body


class BodyLimitMiddleware(HTTPMiddleware):
    def __init__(self, app: Any, max_bytes: int) -> None:
        super().__init__(app)
        self.max_bytes = max_bytes

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, declared)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-upload: the app sees that
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        refusal = check_json_body(message["body"]) if message.get("body") else None
        if refusal is not None:
            await error_response(refusal)(scope, _replay(message, receive), send)
            return
        await self.app(scope, _replay(message, receive), send)

    async def _refuse(self, scope: dict, receive: Any, send: Any, declared: int | None) -> None:
        got = "" if declared is None else f", got {declared}"
        err = APIError(413, f"The request body is too large: at most {self.max_bytes} bytes are accepted{got}.",
                       code="request_too_large")
        await error_response(err, headers={"Connection": "close"})(scope, receive, send)


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers") or []:
        if name == b"content-length":
            # A malformed header is the HTTP server's to reject; here it just is not a number.
            return int(value) if value.isdigit() else None
    return None


def _replay(first: dict, receive: Any) -> Any:
    """A ``receive`` that returns ``first`` once, then the client's own messages (disconnects)."""
    pending = [first]

    async def replayed() -> dict:
        return pending.pop() if pending else await receive()

    return replayed
