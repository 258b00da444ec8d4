"""What the HTTP process's pure-ASGI middlewares share: anything but an HTTP request (lifespan events,
websockets) passes through untouched, so each middleware is written for HTTP requests alone."""

from typing import Any


class HTTPMiddleware:
    """Wraps ``app``; a subclass implements ``handle(scope, receive, send)`` for HTTP requests."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        await self.handle(scope, receive, send)

    async def handle(self, scope: dict, receive: Any, send: Any) -> None:
        raise NotImplementedError
