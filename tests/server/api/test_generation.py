"""Generation: worker outputs -> text deltas, stop strings (per choice for n > 1), errors, timeouts.

A recording stand-in for the worker client lets each test feed exact outputs; the detokenizer and
tokenizer are the real ones.
"""

import asyncio

import pytest
from transformers import AutoTokenizer

from xinserve.engines.core.outputs import StepOutput
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.server.api.generation import Generation
from xinserve.server.errors import APIError
from xinserve.server.pool.fanout import RequestStream
from xinserve.server.worker.messages import RequestError

TEXT = "The river runs to the sea."


class RecordingWorker:
    model_name, label = "m", "cpu"

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.stream: RequestStream | None = None

    def add(self, request_id, prompt_token_ids, params) -> RequestStream:
        self.stream = RequestStream(request_id, params.n)
        return self.stream

    def abort(self, request_id) -> None:
        self.calls.append(("abort", request_id))

    def abort_choice(self, request_id, index, emitted=None) -> None:
        self.calls.append(("abort_choice", request_id, index, emitted))

    def feed(self, index: int, tokens: list[int], finished: bool = False, reason: str | None = None) -> None:
        self.stream.queue.put_nowait(StepOutput("r", index, tokens, finished, reason, None))


def make(tok, n: int = 1, stop: list[str] | None = None, timeout_s: float = 60) -> tuple[Generation, RecordingWorker]:
    worker = RecordingWorker()
    gen = Generation(worker, "r", [0], SamplingParams(n=n, stop=stop or []), tok, timeout_s=timeout_s)
    gen.start()
    return gen, worker


def text_ids(tok) -> list[int]:
    return tok.encode(TEXT, add_special_tokens=False)


async def drain(gen: Generation) -> list[str]:
    pieces = []
    while not gen.done:
        pieces.extend(d.text for d in await gen.next_deltas())
    return pieces


def test_plain_stream_reassembles_text(tiny_tokenizer):
    async def go():
        gen, worker = make(tiny_tokenizer)
        ids = text_ids(tiny_tokenizer)
        for i, t in enumerate(ids):
            worker.feed(0, [t], finished=i == len(ids) - 1, reason="length" if i == len(ids) - 1 else None)
        deltas = await gen.next_deltas()  # everything queued arrives as one coalesced delta
        return gen, deltas

    gen, deltas = asyncio.run(go())
    assert [d.text for d in deltas] == [TEXT]
    assert gen.choices[0].finish_reason == "length"
    assert gen.completion_tokens == len(text_ids(tiny_tokenizer))
    assert gen.first_token_at is not None


def test_stop_string_cuts_and_aborts(tiny_tokenizer):
    async def go():
        gen, worker = make(tiny_tokenizer, stop=["runs"])
        for t in text_ids(tiny_tokenizer):
            worker.feed(0, [t])
        return gen, worker, await drain(gen)

    gen, worker, pieces = asyncio.run(go())
    assert "".join(pieces) == "The river "
    assert gen.choices[0].finish_reason == "stop"
    # the engine never finished it: free it now, saying how many of its tokens were emitted
    assert worker.calls == [("abort_choice", "r", 0, len(gen.choices[0].token_ids)), ("abort", "r")]


def test_a_stop_string_inside_a_multi_token_output_ends_the_choice_at_its_token(tiny_tokenizer):
    """A speculative step hands over its accepted drafts at once: the tokens after the one that
    completes the stop string are not the choice's (as one token per step, they never existed)."""
    async def go(chunk: int):
        gen, worker = make(tiny_tokenizer, stop=["runs"])
        ids = text_ids(tiny_tokenizer)
        for i in range(0, len(ids), chunk):
            worker.feed(0, ids[i : i + chunk])
        return gen, await drain(gen)

    one_by_one, pieces = asyncio.run(go(1))
    drafted, drafted_pieces = asyncio.run(go(len(text_ids(tiny_tokenizer))))  # one output: every token
    assert "".join(drafted_pieces) == "".join(pieces) == "The river "
    assert drafted.choices[0].token_ids == one_by_one.choices[0].token_ids
    assert drafted.completion_tokens == one_by_one.completion_tokens < len(text_ids(tiny_tokenizer))


def test_held_back_text_is_flushed_at_the_end(tiny_tokenizer):
    async def go():
        gen, worker = make(tiny_tokenizer, stop=["sea!"])
        ids = tiny_tokenizer.encode("The river runs to the sea", add_special_tokens=False)
        for t in ids[:-1]:
            worker.feed(0, [t])
        first = await gen.next_deltas()
        worker.feed(0, [ids[-1]], finished=True, reason="length")
        return first, await drain(gen), gen

    first, rest, gen = asyncio.run(go())
    assert "".join(d.text for d in first) + "".join(rest) == "The river runs to the sea"
    assert gen.choices[0].finish_reason == "length"


def test_byte_fallback_output_keeps_its_text(stories_dir):
    """300 byte tokens that never make a character: the answer's text was ""."""
    tok = AutoTokenizer.from_pretrained(stories_dir)
    ids = tok.convert_tokens_to_ids([f"<0x{0x80 + i % 64:02X}>" for i in range(299)] + ["<0xF0>"])

    async def go():
        gen, worker = make(tok)
        for i, t in enumerate(ids):
            worker.feed(0, [t], finished=i == len(ids) - 1, reason="length" if i == len(ids) - 1 else None)
            if i % 50 == 0:
                await gen.next_deltas()
        return gen, await drain(gen)

    gen, _ = asyncio.run(go())
    assert gen.choices[0].text == tok.decode(ids) == "\ufffd" * 300


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text_is_left_out_unless_asked(tiny_tokenizer, include):
    """The engine's "stop" means its last token is EOS or a stop_token_ids hit."""
    async def go():
        worker = RecordingWorker()
        params = SamplingParams(include_stop_str_in_output=include, skip_special_tokens=False)
        gen = Generation(worker, "r", [0], params, tiny_tokenizer)
        gen.start()
        worker.feed(0, [*text_ids(tiny_tokenizer), tiny_tokenizer.eos_token_id], finished=True, reason="stop")
        await drain(gen)
        return gen

    gen = asyncio.run(go())
    assert gen.choices[0].text == TEXT + (tiny_tokenizer.eos_token if include else "")
    assert gen.choices[0].token_ids[-1] == tiny_tokenizer.eos_token_id


def test_stop_strings_wait_for_min_tokens(tiny_tokenizer):
    async def go():
        worker = RecordingWorker()
        gen = Generation(worker, "r", [0], SamplingParams(min_tokens=4, stop=["river"]), tiny_tokenizer)
        gen.start()
        for t in tiny_tokenizer.encode("The river and the river", add_special_tokens=False):
            worker.feed(0, [t])
        await drain(gen)
        return gen

    assert asyncio.run(go()).choices[0].text == "The river and the "


def test_n2_one_choice_stops_early_the_other_runs_on(tiny_tokenizer):
    async def go():
        gen, worker = make(tiny_tokenizer, n=2, stop=["river"])
        ids = text_ids(tiny_tokenizer)
        for i, t in enumerate(ids):
            worker.feed(0, [t])
            worker.feed(1, [t], finished=i == len(ids) - 1, reason="length" if i == len(ids) - 1 else None)
        await drain(gen)
        return gen, worker

    gen, worker = asyncio.run(go())
    # Both choices see the same tokens here, so both stop on "river"; choice 0 is aborted on its own
    # first, then the whole request once the last choice is done.
    assert [c.text for c in gen.choices] == ["The ", "The "]
    assert [c.finish_reason for c in gen.choices] == ["stop", "stop"]
    assert worker.calls[0] == ("abort_choice", "r", 0, len(gen.choices[0].token_ids))
    assert worker.calls[-1] == ("abort", "r")


def test_n2_mixed_finish(tiny_tokenizer):
    async def go():
        gen, worker = make(tiny_tokenizer, n=2, stop=["sea"])
        short = tiny_tokenizer.encode("The river", add_special_tokens=False)
        worker.feed(0, short, finished=True, reason="length")
        for t in text_ids(tiny_tokenizer):
            worker.feed(1, [t])
        await drain(gen)
        return gen, worker

    gen, worker = asyncio.run(go())
    assert [c.text for c in gen.choices] == ["The river", "The river runs to the "]
    assert [c.finish_reason for c in gen.choices] == ["length", "stop"]
    # the last choice is freed with its emitted count (generation_tokens_total), then the whole request
    assert worker.calls == [("abort_choice", "r", 1, len(gen.choices[1].token_ids)), ("abort", "r")]


def test_worker_error_becomes_api_error(tiny_tokenizer):
    async def go(status):
        gen, worker = make(tiny_tokenizer)
        worker.stream.queue.put_nowait(RequestError("nope", client_fault=status == 400, unavailable=status == 503))
        await gen.next_deltas()

    with pytest.raises(APIError) as info:
        asyncio.run(go(400))
    assert (info.value.status, info.value.message) == (400, "nope")
    with pytest.raises(APIError) as info:
        asyncio.run(go(503))
    assert info.value.status == 503


def test_timeout_aborts(tiny_tokenizer):
    async def go():
        gen, worker = make(tiny_tokenizer, timeout_s=0.05)
        try:
            await gen.next_deltas()
        finally:
            calls = list(worker.calls)
        return calls

    with pytest.raises(APIError) as info:
        asyncio.run(go())
    assert (info.value.status, info.value.code) == (504, "timeout")
