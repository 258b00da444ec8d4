"""A one-choice chat or completions stream's ordinary tokens are written from the worker's step callback (``StreamPush``),
not by waking the stream's task: the same bytes, in order even when the server pauses writing, and a
failed write still ends the stream and frees the request in the worker."""

import asyncio
import gc
import json

import pytest
from transformers import AutoTokenizer

from tests.server.api.stream_golden_requests import _VOLATILE, TEXT, ScriptedWorker, body_bytes
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.server.api.generation import Generation
from xinserve.server.api.openai.view import TokenTexts
from xinserve.server.api.stream_push import StreamPush
from xinserve.server.app import create_app
from xinserve.server.config import parse_config

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}
ENDPOINTS = [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hi", "max_tokens": 64})]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class AbortCountingWorker(ScriptedWorker):
    aborted = 0

    def abort(self, request_id: str) -> None:
        self.aborted += 1


def stream(tok, worker, send_hook, path="/v1/chat/completions", body=CHAT) -> list[tuple[dict, object]]:
    """The ASGI messages of one streamed chat request, each with the task that sent it; ``send_hook``
    (a coroutine function of the message number) runs before each message is recorded."""
    app = create_app(parse_config({"models": [{"name": "m", "path": "/nonexistent", "workers": ["cpu"]}]}))
    pool = app.state.router.pools["m"]
    pool.tokenizer, pool.token_texts, pool.workers = tok, TokenTexts(tok), [worker]
    raw = json.dumps({"model": "m", "stream": True, **body}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("test", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}
    sent: list[tuple[dict, object]] = []

    async def go() -> None:
        received = asyncio.Event()

        async def receive() -> dict:
            if not received.is_set():
                received.set()
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()
            return {}

        async def send(message: dict) -> None:
            await send_hook(len(sent))
            sent.append((message, asyncio.current_task()))

        await app(scope, receive, send)

    asyncio.run(go())
    return sent


async def no_wait(_: int) -> None:
    pass


def joined(sent: list[tuple[dict, object]]) -> bytes:
    return b"".join(m.get("body", b"") for m, _ in sent[1:])


def masked(body: bytes) -> bytes:
    """``body`` with its ids and times masked, as the golden bodies are."""
    for pattern, replacement in _VOLATILE:
        body = pattern.sub(replacement, body)
    return body


@pytest.mark.parametrize("path, body", ENDPOINTS)
def test_ordinary_tokens_are_written_by_the_step_callback_with_the_same_bytes(tok, path, body):
    worker = ScriptedWorker(tok.encode(TEXT, add_special_tokens=False))
    sent = stream(tok, worker, no_wait, path, body)
    pushed = [task is worker.task for _, task in sent]
    # The start and first frame come from the handler, the last token's frame, [DONE] and the end from
    # the stream's task; all others but the one that can arrive before the task first waits, pushed.
    assert not any(pushed[:2]) and not any(pushed[-3:]) and sum(pushed) >= len(sent) - 6 > 20
    reference = body_bytes(tok, path, body, TEXT)
    streamed = masked(joined(sent))
    assert streamed == reference and streamed.endswith(b"data: [DONE]\n\n")


def test_a_paused_write_keeps_the_frames_in_order(tok):
    plain = masked(joined(stream(tok, ScriptedWorker(tok.encode(TEXT, add_special_tokens=False)), no_wait)))

    async def pause_some(n: int) -> None:  # flow control: the 3rd, 4th and 9th messages wait a while
        if n in (3, 4, 9):
            await asyncio.sleep(0.02)

    paused = masked(joined(stream(tok, ScriptedWorker(tok.encode(TEXT, add_special_tokens=False)), pause_some)))
    assert paused == plain and paused.count(b"data: {") > 20


def test_a_failed_pushed_write_ends_the_stream_and_frees_the_request(tok):
    worker = AbortCountingWorker(tok.encode(TEXT, add_special_tokens=False))

    async def fail_fourth(n: int) -> None:
        if n == 4:
            raise OSError("connection reset")

    with pytest.raises(OSError):
        stream(tok, worker, fail_fourth)
    assert worker.aborted >= 1


def test_only_one_choice_without_stop_strings_is_pushed(tok):
    def gen(**params) -> Generation:
        return Generation(ScriptedWorker([1]), "r", [1, 2], SamplingParams(max_tokens=4, **params), tok)

    assert StreamPush.for_gens([gen()], lambda deltas: b"") is not None
    assert StreamPush.for_gens([gen(n=2)], lambda deltas: b"") is None
    assert StreamPush.for_gens([gen(stop=["x"])], lambda deltas: b"") is None
    assert StreamPush.for_gens([gen(), gen()], lambda deltas: b"") is None


def test_a_finished_stream_frees_its_push_without_the_cyclic_collector(tok):
    # queue -> push -> generation -> queue is a cycle until the response detaches the push; with the
    # collector off, only reference counting can free the request's objects.
    gc.collect()
    gc.disable()
    try:
        sent = stream(tok, ScriptedWorker(tok.encode(TEXT, add_special_tokens=False)), no_wait)
        del sent
        alive = [o for o in gc.get_objects() if type(o) is StreamPush]
    finally:
        gc.enable()
    assert alive == []
