"""An in-process app (``create_app``) whose one model "m" is served by a stand-in worker, for tests of
the HTTP side's handling of a worker's answers (failures, timeouts) without a worker process."""

import asyncio

from fastapi import FastAPI

from xinserve.engines.core.outputs import StepOutput
from xinserve.server.api.openai.view import TokenTexts
from xinserve.server.app import create_app
from xinserve.server.config import parse_config
from xinserve.server.pool.fanout import RequestStream
from xinserve.server.worker.messages import RequestError

KEYS = {"team-a": "sk-team-a-8c1d2e", "team-b": "sk-team-b-41f07a"}  # the app's API keys, by name


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


class StandInWorker:
    """Ready, roomy, and answers each request with ``tokens`` tokens, then ``end`` ``end_after_s``
    later: a ``RequestError`` (a dead or hung worker's verdict), a finish reason ("stop", "length":
    the last token finishes the request) or None (nothing more: silence)."""

    model_name = "m"
    label = "cpu#7"
    ready = True
    capacity = 8
    load = 0
    stats = None  # what /metrics reads of a worker
    restarts = 0

    def __init__(self, tokens: int, end: RequestError | str | None, end_after_s: float = 0.0) -> None:
        self.tokens, self.end, self.end_after_s = tokens, end, end_after_s
        self.info = {"vocab_size": 512, "max_model_len": 256}
        self.aborted: list[str] = []

    def has_capacity(self, n: int) -> bool:
        return True

    def add(self, request_id, prompt_token_ids, params) -> RequestStream:
        stream = RequestStream(request_id, params.n)
        finishes = isinstance(self.end, str)
        for i in range(self.tokens):
            last = finishes and i == self.tokens - 1
            stream.queue.put_nowait(StepOutput(request_id, 0, [72], last, self.end if last else None, None))
        if isinstance(self.end, RequestError):
            if self.end_after_s:  # after the stream's first frames: a failure mid-stream
                asyncio.get_running_loop().call_later(self.end_after_s, stream.queue.put_nowait, self.end)
            else:
                stream.queue.put_nowait(self.end)
        return stream

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def abort_choice(self, request_id: str, index: int, emitted: int | None = None) -> None:
        self.aborted.append(request_id)


def make_app(tokenizer, worker: StandInWorker, server: dict | None = None, **sections) -> FastAPI:
    """The app of model "m" on ``worker``, keys ``KEYS``; ``server``: more server settings;
    ``sections``: more top-level config sections (``limits``, ...)."""
    config = parse_config({
        "server": {"api_keys": [{"name": n, "key": k} for n, k in KEYS.items()], **(server or {})},
        "models": [{"name": "m", "path": "/nonexistent", "workers": ["cpu"]}],
        **sections,
    })
    app = create_app(config)
    pool = app.state.router.pools["m"]
    pool.tokenizer, pool.token_texts, pool.workers = tokenizer, TokenTexts(tokenizer), [worker]
    return app
