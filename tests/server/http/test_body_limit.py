"""Request bodies over the limit: a 413 in OpenAI's envelope before any parsing, fast, over a real socket."""

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from xinserve.server.app import create_app
from xinserve.server.config import parse_config

MODEL = "tiny"
HUGE = 30 * 1000 * 1000


def make_app(max_body_bytes: int):
    return create_app(parse_config({"limits": {"max_body_bytes": max_body_bytes},
                                    "models": [{"name": "m", "path": "/nonexistent", "workers": ["cpu"]}]}))


def call(app, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
            return await c.post("/v1/chat/completions", **kw)

    return asyncio.run(go())


def assert_413(r: httpx.Response, schemas) -> None:
    assert r.status_code == 413
    schemas.validate("ErrorResponse", r.json())
    assert r.json()["error"]["code"] == "request_too_large"
    assert r.headers["connection"] == "close"


def test_declared_length_over_the_limit_is_refused_unread(schemas):
    # Not even JSON: the 413 comes before any parsing.
    assert_413(call(make_app(1000), content=b"{" * 1001, headers={"content-type": "application/json"}), schemas)


def test_undeclared_length_is_counted_while_reading(schemas):
    read = []

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            read.append(1)
            yield b" " * 300

    assert_413(call(make_app(1000), content=chunks()), schemas)
    assert len(read) < 10  # stopped reading once past the limit


def test_bodies_within_the_limit_reach_the_handler_whole():
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * 500}]}

    async def chunks() -> AsyncIterator[bytes]:
        data = json.dumps(body).encode()
        for i in range(0, len(data), 100):
            yield data[i:i + 100]

    # Validation passed (the model has no worker here: 503), so the handler saw the whole body.
    assert call(make_app(1000), content=chunks(), headers={"content-type": "application/json"}).status_code == 503
    assert call(make_app(1000), json=body).status_code == 503
    r = call(make_app(1000), json={"model": "m"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.fixture(scope="module")
def server(short_tiny_server):
    """The session's short-generation "tiny" server: its body limit is the default one, and these
    tests generate at most 2 tokens."""
    return short_tiny_server


def send_huge(port: int, chunked: bool) -> tuple[float, bytes]:
    """POST a 30 MB body (declared, or chunked) while reading; (seconds to the answer, the answer)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else f"Content-Length: {HUGE}\r\n".encode()
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + framing + b"\r\n"
    piece = b" " * 65536

    def upload() -> None:
        try:
            sent = 0
            while sent < HUGE:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece) if chunked else piece)
                sent += len(piece)
        except OSError:
            pass  # the server answered and closed; the rest was never going to be read

    start = time.monotonic()
    sock.sendall(head)
    writer = threading.Thread(target=upload, daemon=True)
    writer.start()
    answer = b""
    try:
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    except ConnectionResetError:
        pass
    elapsed = time.monotonic() - start
    sock.close()
    writer.join(10)
    return elapsed, answer


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_30mb_body_gets_413_within_a_second(server, schemas, chunked):
    elapsed, answer = send_huge(server.port, chunked)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413"), answer[:500]
    schemas.validate("ErrorResponse", json.loads(rest.partition(b"\r\n\r\n")[2]))
    assert elapsed < 1.0
    # And the server goes on serving.
    r = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200
