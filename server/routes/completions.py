"""POST /v1/completions: one engine request per prompt; choice index = prompt_index * n + i."""

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server import responses
from server.errors import APIError
from server.generation import Delta, Generation
from server.protocol import CompletionRequest
from server.responses import TokenTexts
from server.routes.common import (
    ClientDisconnected,
    log_fields,
    max_tokens_for,
    new_request_id,
    run_until_disconnect,
    sse_response,
)

router = APIRouter()


def _prompt_ids(tokenizer: Any, prompt: str | list[int], vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                       param="prompt")
    return prompt


async def _merged(gens: list[Generation]) -> AsyncIterator[tuple[int, list[Delta]]]:
    """Deltas of several generations as they come, tagged with the generation's position."""
    pending = {asyncio.ensure_future(g.next_deltas()): i for i, g in enumerate(gens) if not g.done}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                yield i, task.result()
                if not gens[i].done:
                    pending[asyncio.ensure_future(gens[i].next_deltas())] = i
    finally:
        for task in pending:
            task.cancel()


class _Combined:
    """Several generations seen as one for logging and metrics (first one's worker and timings)."""

    def __init__(self, gens: list[Generation]) -> None:
        self.gens = gens
        self.request_id = gens[0].request_id
        self.worker = gens[0].worker

    def abort(self) -> None:
        for g in self.gens:
            g.abort()

    @property
    def prompt_tokens(self) -> int:
        return sum(g.prompt_tokens for g in self.gens)

    @property
    def completion_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.gens)


class _AllMetrics:
    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics

    def observe(self, combined: _Combined, end: float) -> None:
        for g in combined.gens:
            self.metrics.observe(g, end)


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    body.check()
    state = request.app.state
    prompts = body.prompts()
    pool, worker = state.router.route(body.model, body.n * len(prompts))
    tokenizer = pool.tokenizer
    max_model_len = int(worker.info["max_model_len"])
    texts: TokenTexts = pool.token_texts
    request_id = new_request_id(request, "cmpl")
    gens, echoes = [], []
    for k, prompt in enumerate(prompts):
        ids = _prompt_ids(tokenizer, prompt, len(tokenizer))
        max_tokens = max_tokens_for(len(ids), body.max_tokens, max_model_len, prompt_param="prompt",
                                    param="max_tokens")
        gens.append(Generation(
            worker,
            request_id if len(prompts) == 1 else f"{request_id}-{k}",
            ids,
            body.sampling_kwargs(max_tokens, body.logprobs),
            tokenizer,
            stop=body.stop_list,
            skip_special_tokens=body.skip_special_tokens,
            timeout_s=state.config.server.request_timeout_s,
        ))
        echoes.append((prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if body.echo else "")
    combined = _Combined(gens)
    created = int(time.time())
    for g in gens:
        g.start()
    try:
        # Streams wait for every prompt's first tokens, so errors still get a real HTTP status.
        firsts = await run_until_disconnect(request, asyncio.gather(*(g.next_deltas() for g in gens)))
        if body.stream:
            frames = _frames(gens, body, pool.name, request_id, created, firsts, echoes, texts)
            return sse_response(request, combined, frames, _AllMetrics(state.metrics))
        await run_until_disconnect(request, _collect_all(gens))
    except ClientDisconnected:
        combined.abort()
        log_fields(request, combined, "disconnected")
        return Response(status_code=499)
    except BaseException:
        combined.abort()
        raise
    log_fields(request, combined, "ok")
    end = time.perf_counter()
    for g in gens:
        state.metrics.observe(g, end)
    choices = []
    for k, g in enumerate(gens):
        for i, c in enumerate(g.choices):
            logprobs = responses.completion_logprobs(c.token_ids, c.logprobs, texts, len(echoes[k]))
            choices.append(responses.completion_choice(k * body.n + i, echoes[k] + c.text, c.finish_reason,
                                                       logprobs))
    usage = responses.usage(combined.prompt_tokens, combined.completion_tokens)
    return JSONResponse(responses.completion(request_id, created, pool.name, choices, usage))


async def _collect_all(gens: list[Generation]) -> None:
    async for _ in _merged(gens):
        pass


async def _frames(
    gens: list[Generation], body: CompletionRequest, model: str, request_id: str, created: int,
    firsts: list[list[Delta]], echoes: list[str], texts: TokenTexts,
) -> AsyncIterator[dict[str, Any]]:
    n = body.n
    offsets = [[len(echoes[k])] * n for k in range(len(gens))]

    def frame(k: int, d: Delta, prefix: str) -> dict[str, Any]:
        logprobs = responses.completion_logprobs(d.token_ids, d.logprobs, texts, offsets[k][d.index])
        offsets[k][d.index] += len(d.text)
        choice = responses.completion_choice(k * n + d.index, prefix + d.text, d.finish_reason, logprobs)
        return responses.completion(request_id, created, model, [choice], None)

    for k, deltas in enumerate(firsts):
        echoed = set()
        for d in deltas:
            yield frame(k, d, echoes[k])
            echoed.add(d.index)
        for i in range(n):  # a choice with no first delta yet still echoes first
            if echoes[k] and i not in echoed:
                yield responses.completion(request_id, created, model,
                                           [responses.completion_choice(k * n + i, echoes[k], None, None)], None)
    async for k, deltas in _merged(gens):
        for d in deltas:
            yield frame(k, d, "")
    if body.include_usage:
        usage = responses.usage(sum(g.prompt_tokens for g in gens), sum(g.completion_tokens for g in gens))
        yield responses.completion(request_id, created, model, [], usage)
