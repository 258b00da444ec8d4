"""One log line per request, written when its response (stream included) has ended.

A pure ASGI middleware rather than Starlette's BaseHTTPMiddleware, which buffers and breaks
streaming cancellation. It assigns the request id (or takes the client's ``X-Request-Id``), echoes
it in the response headers, and logs the fields a handler left in ``request.state.log``, and the name
(never the value) of the API key ``require_api_key`` matched.
"""

import logging
import re
import time
import uuid
from typing import Any

from xinserve.server.http.asgi import HTTPMiddleware

logger = logging.getLogger("xinserve.request")

# Probes and scrapers would drown the log at INFO.
QUIET_PATHS = ("/health", "/health/live", "/metrics")
_SAFE_ID = re.compile(r"^[A-Za-z0-9._-]{1,64}$")


class RequestLogMiddleware(HTTPMiddleware):
    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        state = scope.setdefault("state", {})
        incoming = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        request_id = incoming if _SAFE_ID.match(incoming) else uuid.uuid4().hex
        state["request_id"] = request_id
        start = time.perf_counter()
        status: list[int] = [0]

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            status[0] = status[0] or 500  # the outer error middleware renders the 500 envelope
            raise
        finally:
            self._log(scope, state, request_id, status[0], time.perf_counter() - start)

    @staticmethod
    def _log(scope: dict, state: dict, request_id: str, status: int, latency: float) -> None:
        path = scope.get("path", "")
        level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
        if not logger.isEnabledFor(level):
            return
        fields: dict[str, Any] = state.get("log") or {}
        extra = " ".join(f"{k}={v}" for k, v in fields.items() if k != "outcome")
        key = state.get("api_key")
        if key is not None:
            extra = f"key={key.name} {extra}"
        outcome = fields.get("outcome", "")
        logger.log(level, "request %s %s %s status=%s %s latency=%.3fs%s", request_id, scope.get("method"),
                   path, status or "-", extra, latency, f" outcome={outcome}" if outcome else "")
