"""GenerationGroup.merged: every generation's deltas in order, one prompt without a task per step."""

import asyncio

import pytest
from transformers import AutoTokenizer

from xinserve.engines.core.outputs import StepOutput
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.server.api.generate import GenerationGroup
from xinserve.server.api.generation import Generation
from xinserve.server.pool.fanout import RequestStream


class QueueWorker:
    """A worker client whose streams the test fills by hand."""

    model_name, label = "m", "cpu"

    def __init__(self) -> None:
        self.streams: dict[str, RequestStream] = {}

    def add(self, request_id, prompt_token_ids, params) -> RequestStream:
        self.streams[request_id] = RequestStream(request_id, params.n)
        return self.streams[request_id]

    def abort(self, request_id) -> None:
        pass


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _group(tok, worker: QueueWorker, num_prompts: int) -> GenerationGroup:
    gens = [Generation(worker, f"r{i}", [0], SamplingParams(max_tokens=8), tok) for i in range(num_prompts)]
    group = GenerationGroup("g", gens)
    group.start()
    return group


async def _consume(group: GenerationGroup, worker: QueueWorker, steps: dict[str, list[list[int]]]) -> tuple:
    """Feed one step per request each time the consumer comes back; the deltas seen and tasks made."""
    made = []
    loop = asyncio.get_running_loop()
    loop.set_task_factory(lambda lp, coro, **kw: made.append(1) or asyncio.Task(coro, loop=lp, **kw))
    seen: list[tuple[int, list[int]]] = []
    try:
        for request_id, tokens in steps.items():
            _feed_one(worker, request_id, tokens, 0)
        fed = {request_id: 1 for request_id in steps}
        async for i, deltas in group.merged():
            seen.extend((i, d.token_ids) for d in deltas)
            request_id = f"r{i}"
            if fed[request_id] < len(steps[request_id]):
                _feed_one(worker, request_id, steps[request_id], fed[request_id])
                fed[request_id] += 1
    finally:
        loop.set_task_factory(None)
    return seen, len(made)


def _feed_one(worker: QueueWorker, request_id: str, tokens: list[list[int]], i: int) -> None:
    last = i == len(tokens) - 1
    worker.streams[request_id].queue.put_nowait(StepOutput(request_id, 0, tokens[i], last, "length" if last else None))


def test_one_prompt_streams_every_step_in_order_without_a_task_per_step(tok):
    async def main():
        worker = QueueWorker()
        group = _group(tok, worker, 1)
        steps = {"r0": [[5], [6], [7, 8], [9]]}
        return await _consume(group, worker, steps)

    seen, tasks = asyncio.run(main())
    assert seen == [(0, [5]), (0, [6]), (0, [7, 8]), (0, [9])]
    assert tasks == 0


def test_several_prompts_still_interleave(tok):
    async def main():
        worker = QueueWorker()
        group = _group(tok, worker, 2)
        steps = {"r0": [[5], [6]], "r1": [[7], [8], [9]]}
        return await _consume(group, worker, steps)

    seen, _ = asyncio.run(main())
    assert sorted(t for i, ids in seen if i == 0 for t in ids) == [5, 6]
    assert [t for i, ids in seen if i == 1 for t in ids] == [7, 8, 9]
