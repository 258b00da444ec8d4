"""SSE bursts: chunks ready together go out as one write, in order, each a valid ``data:`` event."""

import asyncio
import json

from starlette.requests import Request

from xinserve.server.api.common import sse_response


class _Group:
    request_id = "r"
    prompt_tokens = completion_tokens = 1
    lora_name = None  # the base model (no LoRA adapter)

    class worker:  # a stand-in for the worker client: its two fields the log line reads
        model_name, label = "m", "cpu"

    def __init__(self) -> None:
        self.aborted = 0

    def abort(self) -> None:
        self.aborted += 1

    def observe(self, metrics, end) -> None:
        pass


def _writes(items: list) -> tuple[list[bytes], _Group]:
    """The body messages an ``sse_response`` over ``items`` sends (one per write)."""

    async def frames():
        for item in items:
            yield item

    async def main():
        group = _Group()
        response = sse_response(Request({"type": "http", "headers": []}), group, frames(), None)
        return [w async for w in response.body_iterator], group

    return asyncio.run(main())


def _events(write: bytes) -> list[dict]:
    parts = write.split(b"\n\n")
    assert parts[-1] == b""  # a write ends on an event boundary
    return [json.loads(p.removeprefix(b"data: ")) for p in parts[:-1]]


def test_a_burst_is_one_write_with_its_chunks_in_order():
    writes, group = _writes([[{"i": 0}, {"i": 1}, {"i": 2, "text": "é\n"}], {"i": 3}, [{"i": 4}]])
    assert writes[-1] == b"data: [DONE]\n\n"
    assert [[e["i"] for e in _events(w)] for w in writes[:-1]] == [[0, 1, 2], [3], [4]]
    assert _events(writes[0])[2]["text"] == "é\n"  # escaped inside the JSON: the framing holds
    assert group.aborted == 1


def test_an_empty_burst_writes_nothing_wrong():
    writes, _ = _writes([[], {"i": 0}])
    assert [_events(w) for w in writes[:-1]] == [[], [{"i": 0}]]


def _strict(raw: bytes) -> dict:
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    return json.loads(raw, parse_constant=refuse)


def test_a_frame_is_strict_json_even_with_an_infinite_logprob():
    chunk = {"choices": [{"logprobs": {"content": [{"token": "a", "logprob": float("-inf")}]}, "delta": {"c": "ü"}}]}
    (write,) = _writes([chunk])[0][:-1]
    event = _strict(write.removeprefix(b"data: ").removesuffix(b"\n\n"))
    assert event["choices"][0]["logprobs"]["content"][0]["logprob"] is None
    assert event["choices"][0]["delta"]["c"] == "ü"
