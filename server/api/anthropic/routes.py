"""POST /v1/messages and /v1/messages/count_tokens: converted to a chat request, then the chat path."""

import uuid
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import Response

from xinserve.server.api.anthropic.convert import chat_request
from xinserve.server.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from xinserve.server.api.anthropic.sse import event_stream_response
from xinserve.server.api.anthropic.view import MessageView
from xinserve.server.api.chat_template import chat_prompt_ids, check_template_kwargs
from xinserve.server.api.generate import respond
from xinserve.server.api.openai.chat import start_chat
from xinserve.server.api.prompt import route_encoded
from xinserve.server.http.auth import may_use
from xinserve.server.http.limits import check_chat

router = APIRouter()


@router.post("/v1/messages", response_model=None)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    # Anthropic's ids read msg_<random>; unique, so also the engine's request id.
    message_id = f"msg_{uuid.uuid4().hex}"
    chat = await start_chat(request, chat_request(body), message_id)
    single_call = body.tool_choice is not None and body.tool_choice.disable_parallel_tool_use
    view = MessageView(message_id, chat.model, chat.plan, single_call)
    return await respond(request, chat.group, body.stream, view.frames, view.body,
                         stream_response=event_stream_response)


@router.post("/v1/messages/count_tokens")
async def count_message_tokens(body: CountTokensRequest, request: Request) -> dict[str, int]:
    """The prompt's length in tokens, as ``/v1/messages`` would template and tokenise it."""
    chat = chat_request(body)
    chat.check()
    state = request.app.state
    check_chat(chat, state.config.limits)
    allowed = partial(may_use, request)
    target = state.router.resolve(chat.model, allowed)
    trust = state.config.server.trust_request_chat_template
    check_template_kwargs(chat.chat_template_kwargs, trust)
    _, _, prompt_ids = await route_encoded(
        state.router, target, 1,
        lambda p: chat_prompt_ids(p.tokenizer, chat, max_chars=state.config.limits.max_prompt_chars,
                                  trust_template=trust),
        may_use=allowed,
    )
    return {"input_tokens": len(prompt_ids)}
