"""POST /v1/completions: one engine request per prompt, then the shared handler."""

import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from xinserve.engines.core.detokenizer import text_offsets
from xinserve.server.api.common import max_tokens_for, new_request_id, sse_frame
from xinserve.server.api.generate import GenerationGroup, respond
from xinserve.server.api.generation import Delta, Generation
from xinserve.server.api.openai import view as responses
from xinserve.server.api.openai.protocol import CompletionRequest
from xinserve.server.api.openai.view import TokenTexts
from xinserve.server.api.prompt import route_encoded
from xinserve.server.api.tokenize.prompt_tokens import encode_prompt
from xinserve.server.disagg.bootstrap import apply_bootstrap
from xinserve.server.disagg.transfer_params import with_transfer_params
from xinserve.server.errors import APIError
from xinserve.server.http.auth import may_use
from xinserve.server.http.limits import cap_max_tokens, check_completion

router = APIRouter()


def _prompt_ids(tokenizer: Any, prompt: str | list[int], vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        return encode_prompt(tokenizer, prompt)
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise APIError(400, f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                       param="prompt")
    return prompt


@router.post("/v1/completions", response_model=None)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    body.check()
    state = request.app.state
    check_completion(body, state.config.limits)
    prompts = body.prompts()
    allowed = partial(may_use, request)
    target = state.router.resolve(body.model, allowed)
    pool, worker, prompt_ids = await route_encoded(
        state.router, target, body.n * len(prompts),
        lambda p: [_prompt_ids(p.tokenizer, prompt, len(p.tokenizer)) for prompt in prompts], may_use=allowed,
    )
    body.check_vocab(int(worker.info["vocab_size"]))
    tokenizer = pool.tokenizer
    max_model_len = int(worker.info["max_model_len"])
    texts: TokenTexts = pool.token_texts
    request_id = new_request_id("cmpl")
    gens, echoes = [], []
    for k, (prompt, ids) in enumerate(zip(prompts, prompt_ids)):
        max_tokens = cap_max_tokens(max_tokens_for(len(ids), body.max_tokens, max_model_len,
                                                   prompt_param="prompt", param="max_tokens"), state.config.limits)
        params = body.sampling_params(max_tokens, body.logprobs, prompt_logprobs=body.prompt_logprobs)
        params.lora_name = target.lora_name
        await apply_bootstrap(body, params, worker.info)
        gens.append(Generation(
            worker,
            request_id if len(prompts) == 1 else f"{request_id}-{k}",
            ids,
            params,
            tokenizer,
            timeout_s=state.config.server.request_timeout_s,
            retry=partial(state.router.replacement, pool, lora_name=target.lora_name),
        ))
        echoes.append((prompt if isinstance(prompt, str) else tokenizer.decode(ids)) if body.echo else "")
    # A text prompt is echoed as sent (no BOS), token ids as decoded with their special tokens.
    view = _CompletionView(body, target.lora_name or pool.name, request_id, echoes, texts, [isinstance(p, str) for p in prompts])
    group = GenerationGroup(request_id, gens)
    return await respond(request, group, bool(body.stream), view.frames, view.body, push=partial(view.push, group))


class _CompletionView:
    """How a completions answer looks: choice index = prompt_index * n + i; echo; legacy log-probs."""

    def __init__(self, body: CompletionRequest, model: str, request_id: str, echoes: list[str],
                 texts: TokenTexts, echoes_skip_special: list[bool]) -> None:
        self.n, self.model, self.request_id = body.n, model, request_id
        self.echoes, self.texts = echoes, texts
        self.echoes_skip_special = echoes_skip_special
        self._prompt_offsets: dict[int, list[int]] = {}  # prompt index -> text_offset of its tokens
        self._offsets = [[len(echo)] * body.n for echo in echoes]  # [prompt][choice] -> text_offset so far
        self.with_usage = body.include_usage
        self.created = int(time.time())

    def body(self, group: GenerationGroup) -> dict[str, Any]:
        choices = []
        for k, g in enumerate(group.gens):
            echo = self.echoes[k]
            for i, c in enumerate(g.choices):
                logprobs = self._with_prompt(k, g, echo, responses.completion_logprobs(
                    c.token_ids, c.logprobs, self.texts, len(echo)))
                choices.append(responses.completion_choice(k * self.n + i, echo + c.text, c.finish_reason, logprobs))
        usage = responses.usage(group.prompt_tokens, group.completion_tokens)
        return with_transfer_params(responses.completion(self.request_id, self.created, self.model, choices, usage),
                                    group.gens[0])

    async def frames(self, group: GenerationGroup, firsts: list[list[Delta]]) -> AsyncIterator[list[dict[str, Any]]]:
        """Bursts of chunks, each burst what one batch of deltas gave (sent as one write)."""
        n, echoes, frame, usage_if_done = self.n, self.echoes, self._frame, self._usage_if_done
        burst = []  # the first deltas of every prompt: one write
        for k, deltas in enumerate(firsts):
            echoed = set()
            for d in deltas:
                burst.append(frame(group, k, d, echoes[k]))
                echoed.add(d.index)
            for i in range(n):  # a choice with no first delta yet still echoes first
                if echoes[k] and i not in echoed:
                    logprobs = self._with_prompt(k, group.gens[k], echoes[k], None)
                    choice = responses.completion_choice(k * n + i, echoes[k], None, logprobs)
                    burst.append(responses.completion(self.request_id, self.created, self.model, [choice], None))
        if burst := burst + usage_if_done(group):
            yield burst
        async for k, deltas in group.merged():
            if burst := [frame(group, k, d, "") for d in deltas] + usage_if_done(group):
                yield burst

    def push(self, group: GenerationGroup, deltas: list[Delta]) -> bytes:
        """The encoded frames ``frames`` would yield for a one-prompt group's ``deltas`` (server/api/stream_push.py)."""
        return b"".join([sse_frame(self._frame(group, 0, d, "")) for d in deltas]
                        + [sse_frame(c) for c in self._usage_if_done(group)])

    def _frame(self, group: GenerationGroup, k: int, d: Delta, prefix: str) -> dict[str, Any]:
        offsets = self._offsets[k]
        logprobs = responses.completion_logprobs(d.token_ids, d.logprobs, self.texts, offsets[d.index])
        logprobs = self._with_prompt(k, group.gens[k], prefix, logprobs)
        offsets[d.index] += len(d.text)
        choice = responses.completion_choice(k * self.n + d.index, prefix + d.text, d.finish_reason, logprobs)
        return responses.completion(self.request_id, self.created, self.model, [choice], None)

    def _usage_if_done(self, group: GenerationGroup) -> list[dict[str, Any]]:
        """The usage chunk, with the burst after which every generation is done."""
        if not self.with_usage or not all(g.done for g in group.gens):
            return []
        usage = responses.usage(group.prompt_tokens, group.completion_tokens)
        return [responses.completion(self.request_id, self.created, self.model, [], usage)]

    def _with_prompt(
        self, k: int, gen: Generation, echo: str, logprobs: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """``logprobs`` after the echoed prompt's own, when ``echo`` is sent here and they were asked for."""
        if not echo or gen.prompt_logprobs is None:
            return logprobs
        offsets = self._prompt_offsets.get(k)
        if offsets is None:
            offsets = self._prompt_offsets[k] = text_offsets(
                self.texts.tokenizer, gen.prompt_token_ids, self.echoes_skip_special[k])
        prompt = responses.prompt_logprobs(gen.prompt_token_ids, gen.prompt_logprobs, self.texts, offsets, echo)
        return responses.join_logprobs(prompt, logprobs)
