"""The API's own description, ``/openapi.json``, and its pages ``/docs`` (Swagger UI) and ``/redoc``.

FastAPI adds these itself without any dependency, so they would answer without a key however the
server is configured; here they are ordinary routes behind the same key check as the rest (each is
reachable without a key only when listed in ``auth_exempt_paths``). The pages fetch
``/openapi.json`` from the browser without the key, so an operator who wants them in a browser
exempts all three.
"""

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

OPENAPI_PATH = "/openapi.json"


def add_docs(app: FastAPI, dependencies: Callable[[str], list[Any]]) -> None:
    """Serve the three paths on ``app`` (built with ``openapi_url=None``); ``dependencies(path)`` are
    the path's dependencies (the key check, or none for an exempt path)."""

    def spec_url(request: Request) -> str:
        return request.scope.get("root_path", "").rstrip("/") + OPENAPI_PATH

    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    async def swagger(request: Request) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url=spec_url(request), title=f"{app.title} - Swagger UI")

    async def redoc(request: Request) -> HTMLResponse:
        return get_redoc_html(openapi_url=spec_url(request), title=f"{app.title} - ReDoc")

    for path, endpoint in ((OPENAPI_PATH, openapi), ("/docs", swagger), ("/redoc", redoc)):
        app.add_api_route(path, endpoint, methods=["GET"], include_in_schema=False, dependencies=dependencies(path))
