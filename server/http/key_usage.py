"""Counts each generation request and its tokens against the API key that made it and the LoRA adapter it
ran with, once it has ended.

A pure ASGI middleware, like the request log, and for the same reason: a stream has ended only when
the app returns. It reads what the request left in its state: the key ``require_api_key`` matched,
and the summary the handler wrote for the log line (model, adapter, prompt and completion tokens), which
generation requests leave whatever their outcome and other requests do not.

A request that fails once routed and started (its worker died, the engine failed, it timed out)
counts its whole prompt, which was sent to the engine, and the tokens generated for it until then;
one refused before it started (a 400, 404, 429 or 503 from validation or routing) counts nothing.
"""

from typing import Any

from xinserve.server.http.asgi import HTTPMiddleware
from xinserve.server.http.metrics import KeyMetrics, LoraMetrics


class KeyUsageMiddleware(HTTPMiddleware):
    def __init__(self, app: Any, metrics: KeyMetrics, loras: LoraMetrics | None = None) -> None:
        super().__init__(app)
        self.metrics = metrics
        self.loras = loras

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        state = scope.setdefault("state", {})
        try:
            await self.app(scope, receive, send)
        finally:
            key, summary = state.get("api_key"), state.get("log")
            if key is not None and summary:
                self.metrics.observe(key.name, summary["model"], summary["prompt_tokens"],
                                     summary["completion_tokens"])
            if self.loras is not None and summary and summary.get("lora"):
                self.loras.observe(summary["lora"], summary["model"], summary["prompt_tokens"],
                                   summary["completion_tokens"])
