"""Generation's one retry: a request whose worker died before any token starts again elsewhere.

Stand-in workers record what they were sent; ``retry`` hands out the next one, as
``Router.replacement`` would.
"""

import asyncio

import pytest

from xinserve.engines.core.outputs import StepOutput
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.server.api.generation import Generation
from xinserve.server.errors import APIError
from xinserve.server.pool.fanout import RequestStream
from xinserve.server.worker.messages import RequestError

DIED = RequestError("worker cpu#0 of m died", unavailable=True, retryable=True)


class Worker:
    model_name = "m"

    def __init__(self, label: str) -> None:
        self.label = label
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.stream: RequestStream | None = None

    def add(self, request_id, prompt_token_ids, params) -> RequestStream:
        self.added.append(request_id)
        self.stream = RequestStream(request_id, params.n)
        return self.stream

    def abort(self, request_id) -> None:
        self.aborted.append(request_id)

    def put(self, item) -> None:
        self.stream.queue.put_nowait(item)


def token(index: int = 0, finished: bool = False) -> StepOutput:
    return StepOutput("r", index, [65], finished, "length" if finished else None, None)


def make(tok, spares: list[Worker | None], n: int = 1) -> tuple[Generation, Worker, list[int]]:
    first = Worker("cpu#0")
    asked: list[int] = []

    async def retry(count: int) -> Worker | None:
        asked.append(count)
        return spares.pop(0)

    gen = Generation(first, "r", [0], SamplingParams(n=n), tok, retry=retry)
    return gen, first, asked


def test_death_before_any_token_is_retried_on_another_worker(tiny_tokenizer):
    async def go():
        spare = Worker("cpu#1")
        gen, first, asked = make(tiny_tokenizer, [spare], n=2)
        gen.start()
        first.put(DIED)
        pending = asyncio.ensure_future(gen.next_deltas())
        await asyncio.sleep(0)  # the retry has run: the request now waits on the spare
        spare.put(token(0, finished=True))
        spare.put(token(1, finished=True))
        deltas = await pending
        return gen, first, spare, asked, deltas

    gen, first, spare, asked, deltas = asyncio.run(go())
    assert asked == [2]  # room for both choices
    assert spare.added == ["r"] and gen.worker is spare
    assert first.aborted == []  # the dead worker holds nothing to abort
    assert [d.finish_reason for d in deltas] == ["length", "length"] and gen.done


def test_death_after_a_token_is_an_error_not_a_retry(tiny_tokenizer):
    async def go():
        gen, first, asked = make(tiny_tokenizer, [Worker("cpu#1")])
        gen.start()
        first.put(token())
        await gen.next_deltas()
        first.put(DIED)
        with pytest.raises(APIError) as info:
            await gen.next_deltas()
        return info.value, asked

    error, asked = asyncio.run(go())
    assert (error.status, error.message) == (503, DIED.message)
    assert asked == []


def test_only_one_retry(tiny_tokenizer):
    async def go():
        spare = Worker("cpu#1")
        gen, first, asked = make(tiny_tokenizer, [spare, Worker("cpu#2")])
        gen.start()
        first.put(DIED)
        pending = asyncio.ensure_future(gen.next_deltas())
        await asyncio.sleep(0)
        spare.put(RequestError("worker cpu#1 of m died", unavailable=True, retryable=True))
        with pytest.raises(APIError) as info:
            await pending
        return info.value, asked

    error, asked = asyncio.run(go())
    assert error.status == 503 and "cpu#1" in error.message
    assert asked == [1]


def test_no_worker_to_retry_on_is_a_503(tiny_tokenizer):
    async def go():
        gen, first, _ = make(tiny_tokenizer, [None])
        gen.start()
        first.put(DIED)
        with pytest.raises(APIError) as info:
            await gen.next_deltas()
        return info.value

    error = asyncio.run(go())
    assert error.status == 503 and "no other worker" in error.message


def test_errors_that_are_verdicts_are_not_retried(tiny_tokenizer):
    async def go():
        gen, first, asked = make(tiny_tokenizer, [Worker("cpu#1")])
        gen.start()
        first.put(RequestError("The server is shutting down.", unavailable=True))
        with pytest.raises(APIError) as info:
            await gen.next_deltas()
        return info.value, asked

    error, asked = asyncio.run(go())
    assert error.message == "The server is shutting down." and asked == []


def test_the_deadline_follows_the_retry(tiny_tokenizer):
    async def go():
        spare = Worker("cpu#1")
        gen, first, _ = make(tiny_tokenizer, [spare])
        gen.timeout_s = 0  # already past when the retry lands
        gen.start()
        first.put(DIED)
        with pytest.raises(APIError) as info:
            await gen.next_deltas()
        return info.value, spare

    error, spare = asyncio.run(go())
    assert error.status == 504 and spare.aborted == ["r"]
