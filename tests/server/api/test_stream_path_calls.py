"""The HTTP process's Python work per streamed chat token stays within a budget of function calls
(counted by cProfile: the same on a loaded machine as on a quiet one). Before the lighter queue,
the finished-choice count, the detokenizer's fast path and the pre-encoded content frames it was
196 calls per token here; 144 after; 122 with ordinary tokens written from the step callback
(server/api/stream_push.py; main without it: 143).

The real app (``create_app``: middleware, routes, generation, detokenisation, frames, metrics) is called
as an ASGI app, no sockets, with ``concurrency`` streamed chat requests at once; a stand-in worker hands
one token to every open request through the real ``Fanout`` once every stream took the previous one."""

import asyncio
import cProfile
import json
import pstats

from transformers import AutoTokenizer

from tests.server.stepping_worker import SteppingWorker
from xinserve.server.api.openai.view import TokenTexts
from xinserve.server.app import create_app
from xinserve.server.config import parse_config

TEXT = "the quick brown fox jumps over a lazy dog while seven happy cats watch from the old red barn"


class LockstepWorker(SteppingWorker):
    async def run(self, until: asyncio.Future) -> None:
        while not until.done():
            # One turn of the loop runs every stream woken by the last step; none open (requests
            # being tokenised in a thread): wait without spinning.
            await asyncio.sleep(0 if self.open else 0.001)
            if all(state[2].queue.empty() for state in self.open.values()):
                self.step()  # every stream took its last token


def calls_per_token(tokenizer_dir: str, concurrency: int, output_tokens: int, requests: int) -> float:
    """Python function calls per streamed token over ``requests`` requests, after levels that take the
    first-call costs out."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokens = [t for w in TEXT.split() for t in tok.encode(" " + w, add_special_tokens=False)]
    app = create_app(parse_config({"models": [{"name": "m", "path": tokenizer_dir, "workers": ["cpu"]}]}))
    pool = app.state.router.pools["m"]
    worker = LockstepWorker(len(tok), tokens)
    pool.tokenizer, pool.token_texts, pool.workers = tok, TokenTexts(tok), [worker]
    raw = json.dumps({"model": "m", "stream": True, "max_tokens": output_tokens,
                      "messages": [{"role": "user", "content": "hello there"}]}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"),
                                          (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}

    async def one() -> None:
        sent = [False]

        async def receive() -> dict:
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await asyncio.Event().wait()
            return {}

        async def send(message: dict) -> None:
            pass

        await app({**scope, "headers": list(scope["headers"])}, receive, send)

    async def level(n: int) -> None:
        sem = asyncio.Semaphore(concurrency)
        until = asyncio.get_running_loop().create_future()
        stepper = asyncio.ensure_future(worker.run(until))

        async def limited() -> None:
            async with sem:
                await one()

        await asyncio.gather(*(limited() for _ in range(n)))
        until.set_result(None)
        await stepper

    asyncio.run(level(concurrency))  # first-call costs out
    asyncio.run(level(requests))  # a second warm level, as when the budget above was set
    profile = cProfile.Profile()
    profile.runcall(asyncio.run, level(requests))
    return pstats.Stats(profile).total_calls / (requests * output_tokens)


def test_a_streamed_chat_token_costs_few_python_calls(tiny_model_dir):
    assert calls_per_token(str(tiny_model_dir), concurrency=8, output_tokens=32, requests=8) < 135
