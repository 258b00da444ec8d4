"""Streamed requests through the app in-process, their whole response bodies as bytes: the golden
bytes of ``test_stream_golden.py`` (recorded from the code before the per-token frame templates)."""

import asyncio
import json
import re

from xinserve.engines.core.outputs import StepOutput, TokenLogprob
from xinserve.server.api.openai.view import TokenTexts
from xinserve.server.app import create_app
from xinserve.server.config import parse_config
from xinserve.server.pool.fanout import RequestStream

TEXT = 'Hello there, "friend"! \\ café 😀 <tab>\there\nnew line'
TOOL_TEXT = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CHAT = {"messages": [{"role": "user", "content": "hi"}]}
# (name, path, body, text the scripted worker generates)
REQUESTS = [
    ("chat", "/v1/chat/completions", {**CHAT, "max_tokens": 64}, TEXT),
    ("chat_usage", "/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}, TEXT),
    ("chat_n2_usage", "/v1/chat/completions", {**CHAT, "n": 2, "stream_options": {"include_usage": True}}, TEXT),
    ("chat_logprobs", "/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}, TEXT),
    ("chat_stop", "/v1/chat/completions", {**CHAT, "stop": ["friend"]}, TEXT),
    ("chat_tools", "/v1/chat/completions", {**CHAT, "tools": [WEATHER], "tool_choice": "required"}, TOOL_TEXT),
    ("completions", "/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, TEXT),
    ("completions_logprobs", "/v1/completions", {"prompt": "hi", "logprobs": 2, "echo": True}, TEXT),
    ("anthropic", "/v1/messages", {**CHAT, "max_tokens": 64}, TEXT),
    ("responses", "/v1/responses", {"input": "hi"}, TEXT),
]
# Per-request values: ids and times.
_VOLATILE = [(re.compile(rb"[0-9a-f]{32}"), b"<hex>"), (re.compile(rb"call_[0-9a-f]+"), b"call_<hex>"), (re.compile(rb'"(created|created_at)":\d+'), rb'"\1":0'),
             (re.compile(rb"ping - [^\n]*"), b"ping")]


class ScriptedWorker:
    """Every choice gets ``tokens`` one per step, with log-probs when asked; a step's outputs are
    delivered once the stream has taken the previous ones, so each step is one wake-up of the stream."""

    model_name, label, ready, capacity, load, stats, restarts = "m", "cpu", True, 8, 0, None, 0

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.info = {"vocab_size": 512, "max_model_len": 256}

    def has_capacity(self, n: int) -> bool:
        return True

    def add(self, request_id, prompt_token_ids, params) -> RequestStream:
        stream = RequestStream(request_id, params.n)
        self.task = asyncio.ensure_future(self._steps(stream, params))
        return stream

    async def _steps(self, stream: RequestStream, params) -> None:
        last = len(self.tokens) - 1
        for k, token in enumerate(self.tokens):
            for i in range(params.n):
                lp = None if params.logprobs is None else [
                    TokenLogprob(-0.25 * (k % 4), [token, (token + 1) % 256], [-0.25 * (k % 4), -1.5])]
                stream.queue.put_nowait(StepOutput(stream.request_id, i, [token], k == last,
                                                   "length" if k == last else None, lp))
            while not stream.queue.empty():
                await asyncio.sleep(0)

    def abort(self, request_id: str) -> None:
        pass

    def abort_choice(self, request_id: str, index: int, emitted: int | None = None) -> None:
        pass


def post_stream(tok, worker, path: str, body: dict) -> list[dict]:
    """The ASGI messages the app sends for one streamed POST of ``body`` served by ``worker``."""
    app = create_app(parse_config({"models": [{"name": "m", "path": "/nonexistent", "workers": ["cpu"]}]}))
    pool = app.state.router.pools["m"]
    pool.tokenizer, pool.token_texts, pool.workers = tok, TokenTexts(tok), [worker]
    raw = json.dumps({"model": "m", "stream": True, **body}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    sent: list[dict] = []

    async def go() -> None:
        received = asyncio.Event()

        async def receive() -> dict:
            if not received.is_set():
                received.set()
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()  # the client never disconnects
            return {}

        async def send(message: dict) -> None:
            sent.append(message)

        await app(scope, receive, send)

    asyncio.run(go())
    return sent


def body_bytes(tok, path: str, body: dict, text: str) -> bytes:
    """The response body of one streamed request (every body message joined), volatile values masked."""
    sent = post_stream(tok, ScriptedWorker(tok.encode(text, add_special_tokens=False)), path, body)
    assert sent[0]["status"] == 200, sent
    out = b"".join(m.get("body", b"") for m in sent[1:])
    for pattern, replacement in _VOLATILE:
        out = pattern.sub(replacement, out)
    return out
