"""Anthropic's error shape on the Messages API's paths: ``{"type": "error", "error": {"type", "message"},
"request_id"}`` with the same HTTP status, so Anthropic's SDKs raise their typed exceptions.

Every error the server renders goes out in OpenAI's envelope (``server/errors.py``), from wherever it
is raised: the body-size limit, the drain, the API-key check, validation, the router, the handler.
``AnthropicErrorMiddleware`` sits outside all of them and rewrites those on ``/v1/messages`` paths,
so none is missed (an exception nothing handled too: ``InternalErrorMiddleware``'s 500).
"""

import json
from typing import Any

from xinserve.server.errors import APIError

PATH_PREFIX = "/v1/messages"

# Anthropic's documented error types by status; other 4xx are invalid requests, other 5xx API errors.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # no worker ready, or draining: Anthropic's "overloaded" (529) means retry later
    529: "overloaded_error",
}


def error_type(status: int) -> str:
    return _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, message: str, request_id: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": error_type(status), "message": message}}
    if request_id:
        body["request_id"] = request_id
    return body


def api_error_body(err: APIError) -> dict[str, Any]:
    return error_body(err.status, err.message)


class AnthropicErrorMiddleware:
    """Pure ASGI: an error response (status >= 400) on a Messages API path is re-rendered in
    Anthropic's shape; any other response, streams included, passes through untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope.get("path", "").startswith(PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        started: dict[str, Any] = {}  # the error response's start message, held until its body is whole
        chunks: list[bytes] = []

        async def rewrite(message: dict) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                started.update(message)
                return
            if message["type"] == "http.response.body" and started:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return
                await _send_error(send, started, b"".join(chunks), _request_id(scope))
                return
            await send(message)

        await self.app(scope, receive, rewrite)


def _request_id(scope: dict) -> str | None:
    return (scope.get("state") or {}).get("request_id")


async def _send_error(send: Any, start: dict, body: bytes, request_id: str | None) -> None:
    status = start["status"]
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):  # not our envelope (a plain-text error): keep its words
        message = body.decode("utf-8", "replace") or f"HTTP {status}"
    # The body's length changes: every header but Content-Length and Content-Type carries over.
    headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length", b"content-type")]
    await _send_json(send, status, error_body(status, str(message), request_id), headers)


async def _send_json(send: Any, status: int, body: dict[str, Any], headers: list) -> None:
    data = json.dumps(body, ensure_ascii=False).encode()
    headers = [*headers, (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
