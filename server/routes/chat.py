"""POST /v1/chat/completions: validate -> template + tokenize -> route -> stream or collect."""

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server import responses
from server.chat_template import chat_prompt_ids
from server.generation import Generation
from server.protocol import ChatCompletionRequest
from server.routes.common import (
    ClientDisconnected,
    collect,
    log_fields,
    max_tokens_for,
    new_request_id,
    run_until_disconnect,
    sse_response,
)

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    body.check()
    state = request.app.state
    pool, worker = state.router.route(body.model, body.n)
    prompt_ids = chat_prompt_ids(pool.tokenizer, body)
    max_model_len = int(worker.info["max_model_len"])
    max_tokens = max_tokens_for(
        len(prompt_ids), body.requested_max_tokens, max_model_len, prompt_param="messages",
        param="max_completion_tokens" if body.max_completion_tokens else "max_tokens",
    )
    gen = Generation(
        worker,
        new_request_id(request, "chatcmpl"),
        prompt_ids,
        body.sampling_kwargs(max_tokens, body.num_logprobs),
        pool.tokenizer,
        stop=body.stop_list,
        skip_special_tokens=body.skip_special_tokens,
        timeout_s=state.config.server.request_timeout_s,
    )
    texts = pool.token_texts
    created = int(time.time())
    gen.start()
    try:
        if body.stream:
            # Wait for the first tokens so that an error still gets a real HTTP status.
            first = await run_until_disconnect(request, gen.next_deltas())
            return sse_response(request, gen, _frames(gen, body, pool.name, created, first, texts), state.metrics)
        await run_until_disconnect(request, collect(gen))
    except ClientDisconnected:
        gen.abort()
        log_fields(request, gen, "disconnected")
        return Response(status_code=499)
    except BaseException:
        gen.abort()
        raise
    log_fields(request, gen, "ok")
    state.metrics.observe(gen, time.perf_counter())
    choices = [
        responses.chat_choice(
            i, c.text, c.finish_reason,
            responses.chat_logprobs(c.token_ids, c.logprobs, texts, body.top_logprobs or 0),
        )
        for i, c in enumerate(gen.choices)
    ]
    usage = responses.usage(gen.prompt_tokens, gen.completion_tokens)
    return JSONResponse(responses.chat_completion(gen.request_id, created, pool.name, choices, usage))


async def _frames(
    gen: Generation, body: ChatCompletionRequest, model: str, created: int, first: list, texts: Any
) -> AsyncIterator[dict[str, Any]]:
    with_usage = body.include_usage
    top = body.top_logprobs or 0

    def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return responses.chat_chunk(gen.request_id, created, model, choices, with_usage=with_usage)

    # The first delta of every choice carries the role, as OpenAI's do.
    for i in range(len(gen.choices)):
        yield chunk([responses.chunk_choice(i, {"role": "assistant", "content": ""})])
    deltas = first
    while deltas:
        for d in deltas:
            logprobs = responses.chat_logprobs(d.token_ids, d.logprobs, texts, top)
            if d.text or d.finish_reason is not None or logprobs is not None:
                delta = {"content": d.text} if d.text or d.finish_reason is None else {}
                yield chunk([responses.chunk_choice(d.index, delta, d.finish_reason, logprobs)])
        deltas = await gen.next_deltas()
    if with_usage:
        usage = responses.usage(gen.prompt_tokens, gen.completion_tokens)
        yield responses.chat_chunk(gen.request_id, created, model, [], with_usage=True, usage_=usage)
