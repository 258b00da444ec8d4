"""POST /v1/chat/completions: the messages through the chat template, then the shared handler."""

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from xinserve.server.api.chat_template import chat_prompt_ids, check_template_kwargs
from xinserve.server.api.common import max_tokens_for, new_request_id, sse_frame
from xinserve.server.api.generate import GenerationGroup, respond
from xinserve.server.api.generation import Delta, Generation
from xinserve.server.api.openai import view as responses
from xinserve.server.api.openai.chat_frames import ContentFrames
from xinserve.server.api.openai.protocol import ChatCompletionRequest
from xinserve.server.api.openai.tools import OutputPlan, plan_output
from xinserve.server.api.openai.view import TokenTexts
from xinserve.server.api.prompt import route_encoded
from xinserve.server.api.reasoning import ThinkSplitter, end_token_id, reasoning_for
from xinserve.server.api.tool_calls.stream import PlainText
from xinserve.server.disagg.bootstrap import apply_bootstrap
from xinserve.server.disagg.transfer_params import with_transfer_params
from xinserve.server.http.auth import may_use
from xinserve.server.http.limits import cap_max_tokens, check_chat

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    chat = await start_chat(request, body, new_request_id("chatcmpl"))
    view = _ChatView(body, chat)
    return await respond(request, chat.group, bool(body.stream), view.frames, view.body, push=view.push)


@dataclass(slots=True)
class ChatRun:
    """A chat request checked, tokenised and routed, its generation built (not yet started)."""

    model: str
    group: GenerationGroup
    plan: OutputPlan
    reasoning: Callable[[], ThinkSplitter] | None  # one splitter per choice; None: no reasoning
    texts: TokenTexts


async def start_chat(request: Request, body: ChatCompletionRequest, request_id: str) -> ChatRun:
    """The one chat path: checks, routing, the chat template, the output plan and the (unstarted)
    generation. Other chat-shaped APIs (the Responses API, ``server/api/anthropic``) convert their request
    and come here."""
    body.check()
    state = request.app.state
    check_chat(body, state.config.limits)
    # Also checked where the template is applied; here too so a refused key is a 400 while no worker is up.
    check_template_kwargs(body.chat_template_kwargs, state.config.server.trust_request_chat_template)
    allowed = partial(may_use, request)
    target = state.router.resolve(body.model, allowed)  # here too: a refused key is a 404 while no worker is up
    # The output plan checks JSON schemas (a few ms for a large one, then cached): in the thread too.
    pool, worker, (prompt_ids, plan) = await route_encoded(
        state.router, target, body.n,
        lambda p: (chat_prompt_ids(p.tokenizer, body, max_chars=state.config.limits.max_prompt_chars,
                                   trust_template=state.config.server.trust_request_chat_template),
                   plan_output(body, p.settings.tool_call_parser, getattr(p.tokenizer, "chat_template", None))),
        may_use=allowed,
    )
    body.check_vocab(int(worker.info["vocab_size"]))
    max_tokens = cap_max_tokens(max_tokens_for(
        len(prompt_ids), body.requested_max_tokens, int(worker.info["max_model_len"]), prompt_param="messages",
        param=body.max_tokens_param,
    ), state.config.limits)
    reasoning = reasoning_for(pool.settings.reasoning_parser, pool.tokenizer, prompt_ids, body.chat_template_kwargs)
    # The grammar applies to the answer, after the reasoning, as vLLM applies it.
    after = end_token_id(pool.tokenizer) if reasoning is not None and plan.json_schema is not None else None
    params = body.sampling_params(max_tokens, body.num_logprobs, json_schema=plan.json_schema)
    params.json_schema_after_token = after
    params.lora_name = target.lora_name
    await apply_bootstrap(body, params, worker.info)
    gen = Generation(
        worker, request_id, prompt_ids, params, pool.tokenizer, timeout_s=state.config.server.request_timeout_s,
        retry=partial(state.router.replacement, pool, lora_name=target.lora_name),
    )
    return ChatRun(target.lora_name or pool.name, GenerationGroup(request_id, [gen]), plan, reasoning,
                   pool.token_texts)


class _ChatView:
    """How a chat answer looks: a message per choice, or chunks with deltas."""

    def __init__(self, body: ChatCompletionRequest, chat: ChatRun) -> None:
        self.model, self.texts = chat.model, chat.texts
        self.top = body.top_logprobs or 0
        self.with_usage = body.include_usage
        self.created = int(time.time())
        self.readers = [chat.plan.new_reader() for _ in range(body.n)]  # content and tool calls per choice
        # reasoning first, per choice: the readers see only the content after it
        self.splitters = [chat.reasoning() if chat.reasoning else None for _ in range(body.n)]
        self.content_frames = ContentFrames(chat.group.request_id, self.created, self.model, self.with_usage)
        self.group = chat.group

    def body(self, group: GenerationGroup) -> dict[str, Any]:
        (gen,) = group.gens
        choices = []
        for i, c in enumerate(gen.choices):
            splitter = self.splitters[i]
            reasoning, text = splitter.split(c.text) if splitter else (None, c.text)
            content, tool_calls = self.readers[i].message(text)
            if reasoning is not None and not content:
                content = None  # all reasoning: no answer yet (cut by max_tokens)
            logprobs = responses.chat_logprobs(c.token_ids, c.logprobs, self.texts, self.top)
            choices.append(responses.chat_choice(
                i, content, _finish_reason(c.finish_reason, bool(tool_calls)), logprobs, tool_calls, reasoning))
        usage = responses.usage(group.prompt_tokens, group.completion_tokens)
        return with_transfer_params(responses.chat_completion(group.request_id, self.created, self.model, choices,
                                                              usage), gen)

    async def frames(
        self, group: GenerationGroup, firsts: list[list[Delta]]
    ) -> AsyncIterator[list[dict[str, Any] | bytes]]:
        """Bursts of chunks, each burst what one batch of deltas gave (sent as one write); a chunk of
        content text alone comes framed already (``ContentFrames``)."""
        (gen,) = group.gens
        # The first delta of every choice carries the role, as OpenAI's do.
        burst = [self._chunk(group, [responses.chunk_choice(i, {"role": "assistant", "content": ""})])
                 for i in range(len(gen.choices))]
        yield self._deltas_burst(group, firsts[0], burst)
        async for _, deltas in group.merged():
            if burst := self._deltas_burst(group, deltas, []):
                yield burst

    def push(self, deltas: list[Delta]) -> bytes:
        """The encoded frames ``frames`` would yield for ``deltas`` (server/api/stream_push.py)."""
        return b"".join(map(sse_frame, self._deltas_burst(self.group, deltas, [])))

    def _deltas_burst(
        self, group: GenerationGroup, deltas: list[Delta], burst: list[dict[str, Any] | bytes]
    ) -> list[dict[str, Any] | bytes]:
        """``burst`` plus the chunks of ``deltas``; the usage chunk too once every choice is done."""
        burst.extend(chunk for d in deltas if (chunk := self._delta_chunk(group, d)) is not None)
        if self.with_usage and group.gens[0].done:
            usage = responses.usage(group.prompt_tokens, group.completion_tokens)
            burst.append(responses.chat_chunk(group.request_id, self.created, self.model, [], with_usage=True,
                                              usage_=usage))
        return burst

    def _chunk(self, group: GenerationGroup, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return responses.chat_chunk(group.request_id, self.created, self.model, choices, with_usage=self.with_usage)

    def _delta_chunk(self, group: GenerationGroup, d: Delta) -> dict[str, Any] | bytes | None:
        reader, splitter = self.readers[d.index], self.splitters[d.index]
        if d.logprobs is None and d.finish_reason is None and splitter is None and type(reader) is PlainText:
            return self.content_frames(d.index, d.text) if d.text else None  # the chunk below, pre-encoded
        logprobs = responses.chat_logprobs(d.token_ids, d.logprobs, self.texts, self.top)
        reasoning, text = "", d.text
        if splitter is not None:
            split = splitter.take(d.text, last=d.finish_reason is not None)
            reasoning, text = split.reasoning, split.content
        content, tool_calls = reader.feed(text)
        if d.finish_reason is not None:
            rest, more_calls = reader.finish()
            content, tool_calls = content + rest, tool_calls + more_calls
        if not content and not reasoning and not tool_calls and d.finish_reason is None and logprobs is None:
            return None
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content or (d.finish_reason is None and not tool_calls and not reasoning):
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = tool_calls
        finish_reason = _finish_reason(d.finish_reason, reader.has_calls)
        return self._chunk(group, [responses.chunk_choice(d.index, delta, finish_reason, logprobs)])


def _finish_reason(reason: str | None, made_calls: bool) -> str | None:
    """A choice that ended by itself after making tool calls ends with "tool_calls", as OpenAI's do."""
    return "tool_calls" if reason == "stop" and made_calls else reason
