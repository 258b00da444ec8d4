"""OpenAI's error envelope and the exception handlers that guarantee every failure uses it.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}`` with ``param``
and ``code`` a string or null, so SDKs raise their typed exceptions (``BadRequestError``, ...); an
unexpected exception as a 500 from ``InternalErrorMiddleware``.
"""

import logging
import traceback
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from xinserve.server.http.asgi import HTTPMiddleware

logger = logging.getLogger("xinserve.server")

# OpenAI's error types by status; the SDK maps the status, clients often switch on the type.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class APIError(Exception):
    """A failure with its HTTP status; raised anywhere in a handler, rendered by ``api_error_handler``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(err: APIError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_response(err: APIError, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)


def _loc_to_param(loc: tuple) -> str | None:
    """("body", "messages", 0, "role") -> "messages.0.role"; pydantic's union branch names dropped."""
    parts = [str(p) for p in loc if p != "body"]
    # Union and tagged-union branches add type names ("list[str]", "function-after[...]") to loc.
    parts = [p for p in parts if not any(c in p for c in "[]()")]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error as a 400; malformed JSON gets its own message."""
    errors = exc.errors()
    first = errors[0] if errors else {"msg": "invalid request", "loc": (), "type": ""}
    if first.get("type") == "json_invalid":
        return APIError(400, f"We could not parse the JSON body of your request: {first.get('msg')}")
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value"))
    msg = msg.removeprefix("Value error, ")
    if first.get("type") == "missing" and param:
        return APIError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    text = f"Invalid value for '{param}': {msg}" if param else msg
    return APIError(400, text, param=param, code="invalid_value")


async def api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc)


async def validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(validation_error(exc))


async def http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's own errors (unknown route 404, wrong method 405) in the same envelope."""
    return error_response(APIError(exc.status_code, str(exc.detail)), headers=getattr(exc, "headers", None))


# An internal error's log entry: its innermost frames (where it failed) and at most this much text. A
# RecursionError's 1,000 frames, logged twice, were 470 KB of log for a 1 KB request.
LOGGED_FRAMES = 40
LOGGED_CHARS = 16_000


def bounded_traceback(exc: BaseException) -> str:
    text = "".join(traceback.format_exception(exc, limit=-LOGGED_FRAMES))
    if len(text) <= LOGGED_CHARS:
        return text
    half = LOGGED_CHARS // 2
    return f"{text[:half]}\n... ({len(text) - 2 * half} characters cut) ...\n{text[-half:]}"


class InternalErrorMiddleware(HTTPMiddleware):
    """Pure ASGI: an exception nothing handled becomes a 500 in OpenAI's envelope, logged here once
    (``bounded_traceback``). It is not re-raised: the ASGI server would log it a second time and
    drop the kept-alive connection. After the response has started only the log is left to write
    (the server then ends the unfinished response). A failed write (the client gone) is not ours:
    it is re-raised, unlogged, for the ASGI server."""

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        started = send_failed = False

        async def watched(message: dict) -> None:
            nonlocal started, send_failed
            started = started or message["type"] == "http.response.start"
            try:
                await send(message)
            except Exception:
                send_failed = True
                raise

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:  # whatever it is, the client gets a 500 and the log one entry
            # The connection's own failure (a client gone; a pushed write fails outside ``watched``): the
            # ASGI server's to handle, as before this middleware.
            if send_failed or (started and isinstance(exc, OSError)):
                raise
            request_id = (scope.get("state") or {}).get("request_id") or "-"
            logger.error("internal error in request %s %s %s\n%s", request_id, scope.get("method"),
                         scope.get("path"), bounded_traceback(exc))
            if not started:
                err = APIError(500, f"The server had an error while processing your request (request id {request_id}).")
                await error_response(err)(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
