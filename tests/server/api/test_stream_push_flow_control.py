"""``StreamPush`` under real uvicorn flow control: a stand-in worker delivers its steps from a plain loop
callback (as ``WorkerClient._on_readable`` does, outside any task), the server's write buffers are tiny
and the client reads slowly, so pushed writes pause (``_finish`` takes them over) many times. The
stream must still arrive whole and in order, and a client that goes away while a pushed write waits
must leave no request behind in the worker."""

import asyncio
import json
import re
import socket
from collections.abc import Callable

import pytest
import uvicorn
from transformers import AutoTokenizer
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from tests.server.stepping_worker import SteppingWorker
from xinserve.server.api import stream_push
from xinserve.server.api.openai.view import TokenTexts
from xinserve.server.app import create_app
from xinserve.server.config import parse_config

TEXT = "the quick brown fox jumps over a lazy dog while seven happy cats watch from the old red barn"
MAX_TOKENS = 400
_VOLATILE = [(re.compile(rb"[0-9a-f]{32}"), b"<hex>"), (re.compile(rb'"created":\d+'), b'"created":0')]


class TinyBuffers(HttpToolsProtocol):
    """uvicorn's protocol with write buffers small enough that a slow reader pauses writing at once."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        transport.set_write_buffer_limits(high=256)


class CallbackWorker(SteppingWorker):
    """A step every millisecond while requests are open, run from ``call_later`` (no task)."""

    ticking = False

    def add(self, request_id, prompt_token_ids, params):
        stream = super().add(request_id, prompt_token_ids, params)
        if not self.ticking:
            self.ticking = True
            asyncio.get_running_loop().call_later(0.001, self._tick)
        return stream

    def _tick(self) -> None:
        self.step()
        if self.open:
            asyncio.get_running_loop().call_later(0.001, self._tick)
        else:
            self.ticking = False


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def request_bytes(path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


def dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response (``raw``: everything after the headers)."""
    body, at = b"", 0
    while True:
        end = raw.index(b"\r\n", at)
        size = int(raw[at:end], 16)
        if size == 0:
            return body
        body += raw[end + 2:end + 2 + size]
        at = end + 2 + size + 2


async def fetch(port: int, path: str, payload: bytes, pause_s: float, stop_after: int | None = None,
                read_after: Callable[[], bool] = lambda: True) -> bytes:
    """The response body, read ``pause_s`` apart 512 bytes at a time through a tiny receive buffer,
    once ``read_after()`` holds (checked every 10 ms, up to 30 s); ``stop_after``: close the
    connection once that many bytes came (the client goes away)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    sock.setblocking(False)
    await loop.sock_connect(sock, ("127.0.0.1", port))
    await loop.sock_sendall(sock, request_bytes(path, payload))
    for _ in range(3000):
        if read_after():
            break
        await asyncio.sleep(0.01)
    raw = b""
    try:
        while not raw.endswith(b"\r\n0\r\n\r\n"):
            data = await asyncio.wait_for(loop.sock_recv(sock, 512), 30)
            if not data:
                break
            raw += data
            if stop_after is not None and len(raw) >= stop_after:
                return raw
            await asyncio.sleep(pause_s)
    finally:
        sock.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    body = dechunk(rest)
    for pattern, replacement in _VOLATILE:
        body = pattern.sub(replacement, body)
    return body


def streamed_text(body: bytes) -> str:
    """The text of a chat or completions stream's chunks, joined."""
    text = ""
    for line in body.split(b"\n\n"):
        if line.startswith(b"data: {"):
            (choice,) = json.loads(line[6:])["choices"]
            text += choice["delta"].get("content", "") if "delta" in choice else choice["text"]
    return text


def serve_and(tok, scenario) -> None:
    """Run ``scenario(port, worker)`` against the real app served by uvicorn in this loop."""
    app = create_app(parse_config({"models": [{"name": "m", "path": "/nonexistent", "workers": ["cpu"]}]}))
    pool = app.state.router.pools["m"]
    tokens = [t for w in TEXT.split() for t in tok.encode(" " + w, add_special_tokens=False)]
    worker = CallbackWorker(len(tok), tokens)
    pool.tokenizer, pool.token_texts, pool.workers = tok, TokenTexts(tok), [worker]

    async def go() -> None:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False,
                                               http=TinyBuffers))
        serving = asyncio.ensure_future(server.serve(sockets=[listener]))
        while not server.started:
            await asyncio.sleep(0.01)
        try:
            await scenario(listener.getsockname()[1], worker)
        finally:
            server.should_exit = True
            await serving

    asyncio.run(go())


@pytest.fixture
def paused(monkeypatch) -> list[int]:
    """Counts the pushed writes that found writing paused (and went on in ``_finish``)."""
    count = [0]
    finish = stream_push._finish

    def counted(coro, blocker):
        count[0] += 1
        return finish(coro, blocker)

    monkeypatch.setattr(stream_push, "_finish", counted)
    return count


CHAT = b'{"model":"m","stream":true,"max_tokens":%d,"messages":[{"role":"user","content":"hi"}]}' % MAX_TOKENS
COMPLETION = b'{"model":"m","stream":true,"max_tokens":%d,"prompt":"hi"}' % MAX_TOKENS


@pytest.mark.parametrize("path, payload", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_a_slow_reader_gets_the_whole_stream_in_order(tok, paused, path, payload):
    bodies = {}

    async def scenario(port: int, worker: CallbackWorker) -> None:
        bodies["fast"] = await fetch(port, path, payload, 0)
        before = paused[0]  # the slow reader starts once one of its stream's pushed writes paused
        bodies["slow"] = await fetch(port, path, payload, 0.002, read_after=lambda: paused[0] > before)
        assert paused[0] > before
        assert worker.fanout.load == 0

    serve_and(tok, scenario)
    fast, slow = bodies["fast"], bodies["slow"]
    # The same text in the same order; a reader that fell behind may get several tokens in one frame.
    assert fast.count(b"data: {") >= MAX_TOKENS and slow.endswith(b"data: [DONE]\n\n")
    assert streamed_text(slow) == streamed_text(fast) and len(streamed_text(fast)) > 500


def test_a_client_gone_during_a_paused_push_leaves_no_request_behind(tok, paused):
    async def scenario(port: int, worker: CallbackWorker) -> None:
        await fetch(port, "/v1/chat/completions", CHAT, 0.01, stop_after=4096, read_after=lambda: paused[0] > 0)
        for _ in range(500):  # the disconnect is seen by the server's next read
            if worker.fanout.load == 0:
                break
            await asyncio.sleep(0.01)
        assert worker.fanout.load == 0
        # and the server still serves
        assert (await fetch(port, "/v1/chat/completions", CHAT, 0)).endswith(b"data: [DONE]\n\n")

    serve_and(tok, scenario)
    assert paused[0] > 0
