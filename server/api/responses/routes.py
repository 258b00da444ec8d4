"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A response runs as the chat request its input converts to (``server/api/responses/convert.py``),
through chat's own start (``start_chat``) and the shared handler path; only the shape of the answer
differs: output items, and a stream of typed events each with a ``sequence_number`` (a failure
after the first event: an ``error`` event, then ``response.failed``); errors name Responses' fields.
"""

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response

from xinserve.server.api.common import event_stream, sse_frame
from xinserve.server.api.generate import GenerationGroup, respond
from xinserve.server.api.generation import Delta
from xinserve.server.api.openai.chat import ChatRun, start_chat
from xinserve.server.api.reasoning import end_token_id
from xinserve.server.api.responses.convert import (
    answer_message,
    chat_request,
    input_messages,
    responses_error,
)
from xinserve.server.api.responses.output import OutputItems, new_id
from xinserve.server.api.responses.protocol import ResponsesRequest
from xinserve.server.api.responses.store import ResponseStore
from xinserve.server.api.sse import SSEResponse
from xinserve.server.errors import APIError

router = APIRouter()


def _store(app: FastAPI) -> ResponseStore:
    return app.state.response_store


def _owner(request: Request) -> str:
    key = getattr(request.state, "api_key", None)
    return key.name if key is not None else ""


@router.post("/v1/responses", response_model=None)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    if body.background:
        raise APIError(400, "background responses are not supported by this server", param="background")
    store, owner = _store(request.app), _owner(request)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        history = store.get(body.previous_response_id, owner, "previous_response_id").messages
    messages = [*history, *input_messages(body)]
    try:  # chat's checks (limits, context, template) apply, named after the Responses fields
        chat = await start_chat(request, chat_request(body, messages), new_id("resp"))
    except APIError as exc:
        raise responses_error(exc) from None
    view = _ResponseView(body, chat, messages, store, owner)
    return await respond(request, chat.group, body.stream, view.frames, view.body, stream_response=view.stream)


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict[str, Any]:
    return _store(request.app).get(response_id, _owner(request)).response


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
    _store(request.app).delete(response_id, _owner(request))
    return {"id": response_id, "object": "response", "deleted": True}


class _ResponseView:
    """The answer as a Response object, or as the stream of events that builds one."""

    def __init__(self, body: ResponsesRequest, chat: ChatRun, messages: list[dict[str, Any]],
                 store: ResponseStore, owner: str) -> None:
        self.request, self.chat, self.messages, self.store, self.owner = body, chat, messages, store, owner
        self.reader = chat.plan.new_reader()
        self.splitter = chat.reasoning() if chat.reasoning else None
        self.out = OutputItems()
        self.sequence = 0
        self.response = _response_object(body, chat.group.request_id, chat.model)

    def body(self, group: GenerationGroup) -> dict[str, Any]:
        (gen,) = group.gens
        self._feed(gen.choices[0].text, last=True)
        return self._final(group)

    async def frames(self, group: GenerationGroup, firsts: list[list[Delta]]) -> AsyncIterator[dict[str, Any] | bytes]:
        yield self._numbered({"type": "response.created", "response": dict(self.response)})
        yield self._numbered({"type": "response.in_progress", "response": dict(self.response)})
        for d in firsts[0]:
            self._feed(d.text, last=d.finish_reason is not None)
        for event in self._events():
            yield event
        async for _, deltas in group.merged():
            for d in deltas:
                self._feed(d.text, last=d.finish_reason is not None)
            for event in self._events():
                yield event
        final = self._final(group)
        for event in self._events():
            yield event
        done = "response.completed" if final["status"] == "completed" else "response.incomplete"
        # The last event: Responses has no ``data: [DONE]`` (a failed stream ends at ``response.failed``).
        yield self._numbered({"type": done, "response": final})

    def stream(self, request: Request, group: GenerationGroup, frames: AsyncIterator[Any],
               metrics: Any) -> SSEResponse:
        return event_stream(request, group, frames, metrics, frame=sse_frame, error_body=self.failed)

    def failed(self, err: APIError) -> list[dict[str, Any]]:
        """A failure after the first event (a worker lost, a timeout): Responses' ``error`` event,
        then ``response.failed`` with the output so far, each numbered on."""
        self.out.finish("incomplete")
        self.out.events.clear()  # the stream ends here: no closing events for the cut item
        response = self.response
        response["status"] = "failed"
        response["output"] = self.out.items
        response["error"] = {"code": _failure_code(err.status), "message": err.message}
        error = {"type": "error", "code": err.code or err.type, "message": err.message, "param": err.param}
        return [self._numbered(error), self._numbered({"type": "response.failed", "response": response})]

    def _feed(self, text: str, last: bool) -> None:
        content = text
        if self.splitter is not None:
            split = self.splitter.take(text, last)
            self.out.reasoning(split.reasoning)
            content = split.content
        piece, calls = self.reader.feed(content)
        if last:
            rest_piece, more_calls = self.reader.finish()
            piece, calls = piece + rest_piece, calls + more_calls
        self.out.text(piece)
        for call in calls:
            self.out.tool_call(call)

    def _events(self) -> list[dict[str, Any]]:
        events = [self._numbered(e) for e in self.out.events]
        self.out.events.clear()
        return events

    def _numbered(self, event: dict[str, Any]) -> dict[str, Any]:
        event["sequence_number"] = self.sequence
        self.sequence += 1
        return event

    def _final(self, group: GenerationGroup) -> dict[str, Any]:
        (gen,) = group.gens
        choice = gen.choices[0]
        incomplete = choice.finish_reason == "length"
        self.out.finish("incomplete" if incomplete else "completed")
        response = self.response
        response["status"] = "incomplete" if incomplete else "completed"
        response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        response["output"] = self.out.items
        response["usage"] = self._usage(group, choice.token_ids)
        if self.request.store:
            answer = answer_message(self.out.content, self.out.calls)
            self.store.put(self.owner, response, [*self.messages, answer])
        return response

    def _usage(self, group: GenerationGroup, token_ids: list[int]) -> dict[str, Any]:
        reasoning = 0
        if self.splitter is not None and self.splitter.saw_reasoning:
            end = end_token_id(self.chat.texts.tokenizer)
            reasoning = token_ids.index(end) + 1 if end in token_ids else len(token_ids)
        return {"input_tokens": group.prompt_tokens, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                "output_tokens": group.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
                "total_tokens": group.prompt_tokens + group.completion_tokens}




def _failure_code(status: int) -> str:
    """A failed Response's ``error.code`` (one of Responses' documented codes) for an HTTP status."""
    if status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if status < 500 else "server_error"


def _response_object(body: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The Response as it starts: in progress, no output yet; the request's settings echoed."""
    fmt = body.text.format.model_dump(by_alias=True, exclude_none=True) if body.text and body.text.format else None
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
              "strict": t.strict} for t in body.tools or []]
    response = {
        "id": response_id, "object": "response", "created_at": int(time.time()), "model": model,
        "status": "in_progress", "output": [], "error": None, "incomplete_details": None,
        "instructions": body.instructions, "metadata": body.metadata or {}, "temperature": body.temperature,
        "top_p": body.top_p, "max_output_tokens": body.max_output_tokens, "parallel_tool_calls": body.parallel_tool_calls,
        "tool_choice": body.tool_choice or "auto", "tools": tools, "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": body.reasoning.effort, "summary": body.reasoning.summary} if body.reasoning else None,
        "store": body.store, "text": {"format": fmt or {"type": "text"}}, "truncation": "disabled",
    }
    if body.user is not None:  # optional and not nullable in the schema, as ``usage`` until the end
        response["user"] = body.user
    return response
