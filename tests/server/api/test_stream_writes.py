"""Streamed chat and completions through the app in-process: the ASGI body messages (one per write)
carry whole events in order, the chunks that were ready together in one message (chat), usage last."""

import asyncio
import json

import pytest
from transformers import AutoTokenizer

from tests.server.api.stream_golden_requests import post_stream
from xinserve.engines.core.outputs import StepOutput
from xinserve.server.pool.fanout import RequestStream


class OneAtATime(asyncio.Queue):
    """Hands out one scripted output per wait, as a worker's steps arrive one by one."""

    def __init__(self, items: list) -> None:
        super().__init__()
        self.items = list(items)

    async def get(self):
        await asyncio.sleep(0)
        return self.items.pop(0)

    def empty(self) -> bool:
        return True


class ScriptedWorker:
    model_name, label, ready, capacity, load, stats, restarts = "m", "cpu", True, 8, 0, None, 0

    def __init__(self, steps: list[list[int]]) -> None:
        self.steps = steps
        self.info = {"vocab_size": 512, "max_model_len": 256}

    def has_capacity(self, n: int) -> bool:
        return True

    def add(self, request_id, prompt_token_ids, params) -> RequestStream:
        outputs = [StepOutput(request_id, i, ids, k == len(self.steps) - 1, "length" if k == len(self.steps) - 1 else None)
                   for k, ids in enumerate(self.steps) for i in range(params.n)]
        return RequestStream(request_id, params.n, queue=OneAtATime(outputs))

    def abort(self, request_id: str) -> None:
        pass

    def abort_choice(self, request_id: str, index: int, emitted: int | None = None) -> None:
        pass


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _writes(tok, path: str, body: dict, steps: list[list[int]]) -> list[list]:
    """The body messages of one streamed request, each as its events (``[DONE]`` as the string)."""
    sent = post_stream(tok, ScriptedWorker(steps), path, body)
    assert sent[0]["status"] == 200
    writes = []
    for m in sent[1:]:
        if m.get("body"):
            events = m["body"].split(b"\n\n")
            assert events[-1] == b""  # a write ends on an event boundary
            writes.append([e if e == b"data: [DONE]" else json.loads(e.removeprefix(b"data: ")) for e in events[:-1]])
    return writes


def test_chat_role_and_first_delta_share_a_write_and_usage_ends_the_last(tok):
    steps = [tok.encode(w, add_special_tokens=False) for w in ("Hello", " there", " friend")]
    writes = _writes(tok, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                    "stream_options": {"include_usage": True}}, steps)
    first, *middle, last, done = writes
    assert [c["choices"][0]["delta"] for c in first] == [{"role": "assistant", "content": ""}, {"content": "Hello"}]
    assert [w[0]["choices"][0]["delta"]["content"] for w in middle] == [" there"]
    assert [len(w) for w in middle] == [1]
    assert last[0]["choices"][0]["finish_reason"] == "length" and last[0]["choices"][0]["delta"]["content"] == " friend"
    assert last[1]["choices"] == [] and last[1]["usage"]["completion_tokens"] == sum(map(len, steps))
    assert done == [b"data: [DONE]"]


def test_completions_n2_stream_keeps_every_choice_and_ends_with_usage(tok):
    steps = [tok.encode(w, add_special_tokens=False) for w in ("Hello", " there")]
    writes = _writes(tok, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2,
                                              "stream_options": {"include_usage": True}}, steps)
    texts = [[(c["choices"][0]["index"], c["choices"][0]["text"]) for c in w if c["choices"]] for w in writes[:-1]]
    assert sorted(t for w in texts for t in w) == [(0, " there"), (0, "Hello"), (1, " there"), (1, "Hello")]
    assert "usage" in writes[-2][-1] and writes[-2][-1]["usage"]["completion_tokens"] == 2 * sum(map(len, steps))
    assert writes[-1] == [b"data: [DONE]"]
