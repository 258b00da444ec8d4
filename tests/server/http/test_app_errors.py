"""The app in-process, without starting workers: every failure uses OpenAI's envelope.

The ASGI transport does not run the lifespan, so the pools exist but never load: requests for the
model meet "no worker ready" (503), which lets validation, auth, 404/405 and 500 be pinned fast.
"""

import asyncio

import httpx
import pytest

from xinserve.server.app import create_app
from xinserve.server.config import parse_config

KEY = "sk-unit"


def make_app(**server):
    config = parse_config({"server": {"api_keys": [KEY], **server},
                           "models": [{"name": "m", "path": "/nonexistent", "workers": ["cpu"]}]})
    return create_app(config)


def call(app, method: str, path: str, raise_app_exceptions: bool = False, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def envelope(r: httpx.Response) -> dict:
    body = r.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] is None or isinstance(error["code"], str)
    return error


AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_auth_required_for_api_but_not_health_or_metrics():
    app = make_app()
    r = call(app, "POST", "/v1/chat/completions", json=CHAT)
    assert r.status_code == 401 and envelope(r)["code"] == "invalid_api_key"
    r = call(app, "GET", "/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert call(app, "GET", "/v1/models", headers=AUTH).status_code == 200
    assert call(app, "GET", "/health").status_code == 503  # open, and not ready
    assert call(app, "GET", "/metrics").status_code == 200


def test_health_and_metrics_can_be_protected():
    app = make_app(auth_exempt_paths=[])
    assert call(app, "GET", "/health").status_code == 401
    assert call(app, "GET", "/metrics").status_code == 401
    assert call(app, "GET", "/metrics", headers=AUTH).status_code == 200


def test_validation_is_400_with_param():
    app = make_app()
    r = call(app, "POST", "/v1/chat/completions", json={**CHAT, "temperature": 9}, headers=AUTH)
    assert r.status_code == 400 and envelope(r)["param"] == "temperature"
    r = call(app, "POST", "/v1/chat/completions", content=b"{nope", headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in envelope(r)["message"]
    r = call(app, "POST", "/v1/completions", json={"model": "m"}, headers=AUTH)
    assert r.status_code == 400 and envelope(r)["param"] == "prompt"


def test_unknown_model_404_and_unready_model_503():
    app = make_app()
    r = call(app, "POST", "/v1/chat/completions", json={**CHAT, "model": "x"}, headers=AUTH)
    assert r.status_code == 404 and envelope(r)["code"] == "model_not_found"
    r = call(app, "POST", "/v1/chat/completions", json=CHAT, headers=AUTH)
    assert r.status_code == 503 and envelope(r)["type"] == "service_unavailable_error"
    r = call(app, "GET", "/v1/models/x", headers=AUTH)
    assert r.status_code == 404
    envelope(r)


def test_unknown_route_and_method():
    app = make_app()
    r = call(app, "GET", "/v2/whatever", headers=AUTH)
    assert r.status_code == 404
    envelope(r)
    r = call(app, "GET", "/v1/chat/completions", headers=AUTH)
    assert r.status_code == 405
    envelope(r)


def test_internal_error_is_a_500_envelope_with_request_id(monkeypatch, caplog):
    app = make_app()

    def boom(name, n=1):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(app.state.router, "route", boom)
    r = call(app, "POST", "/v1/chat/completions", json=CHAT, headers={**AUTH, "X-Request-Id": "abc123"})
    assert r.status_code == 500
    error = envelope(r)
    assert "abc123" in error["message"] and "kaboom" not in error["message"]
    assert any("abc123" in rec.getMessage() for rec in caplog.records)
    # The app keeps serving.
    assert call(app, "GET", "/v1/models", headers=AUTH).status_code == 200


def recurse(depth: int) -> None:
    recurse(depth + 1)  # a RecursionError: a traceback of ~1,000 frames


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", CHAT),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
])
def test_an_internal_error_is_logged_once_with_a_bounded_traceback_and_not_raised_to_the_server(
        monkeypatch, caplog, path, body):
    app = make_app()
    monkeypatch.setattr(app.state.router, "route", lambda *a, **k: recurse(0))
    # raise_app_exceptions: an exception that reached the ASGI server would raise here. Uvicorn logged
    # it a second time and dropped the kept-alive connection.
    r = call(app, "POST", path, json=body, headers={**AUTH, "X-Request-Id": "deep1"}, raise_app_exceptions=True)
    assert r.status_code == 500 and "deep1" in r.text
    tracebacks = [text for text in map(caplog.handler.format, caplog.records) if "Traceback" in text]
    assert len(tracebacks) == 1, [text[:300] for text in tracebacks]
    assert "deep1" in tracebacks[0] and "RecursionError" in tracebacks[0]
    assert len(tracebacks[0]) < 20_000  # the innermost frames, not 1,000 of them (~200 KB)


@pytest.mark.parametrize("path", ["/v1/models", "/health"])
def test_request_id_header(path):
    r = call(make_app(), "GET", path, headers={**AUTH, "X-Request-Id": "my-id-1"})
    assert r.headers["x-request-id"] == "my-id-1"
    assert len(call(make_app(), "GET", path, headers=AUTH).headers["x-request-id"]) == 32
