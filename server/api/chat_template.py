"""OpenAI chat messages -> prompt token ids through the model's own chat template.

``chat_template_kwargs`` are the template's own variables (``enable_thinking``, ``documents``,
``continue_final_message``). A key that is an argument of ``apply_chat_template`` itself rather than
a template variable is refused: ``chat_template`` replaces the template (code that runs here, and a
cheap body can render millions of tokens), so it needs the operator's
``trust_request_chat_template``; the others are the server's own (``tools`` and
``add_generation_prompt`` are request fields; the prompt is tokenised here, after rendering) and
are always refused. The rendered text is bounded by ``limits.max_prompt_chars`` before tokenising.
"""

import json
from typing import Any

from jinja2 import TemplateError

from xinserve.server.api.openai.protocol import ChatCompletionRequest, ChatMessage
from xinserve.server.errors import APIError
from xinserve.server.http.json_body import MAX_JSON_DEPTH, nested_deeper_than

TEMPLATE_KEY = "chat_template"
# Arguments of transformers' ``apply_chat_template`` that the server sets itself or that only apply
# to its tokenising; ``messages`` and ``conversation`` name the messages.
_SERVER_KEYS = frozenset({
    "conversation", "messages", "tools", "add_generation_prompt", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs",
})


def template_message(message: ChatMessage, param: str = "messages") -> dict[str, Any]:
    """The dict a Hugging Face chat template expects; "developer" is rendered as "system".
    ``param``: the message's place in the request ("messages.3"), which a 400 names."""
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [_template_tool_call(call, f"{param}.tool_calls.{i}")
                             for i, call in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _template_tool_call(call: dict[str, Any], param: str) -> dict[str, Any]:
    """OpenAI sends a call's arguments as JSON text; chat templates (Qwen's, Llama's, GLM's) iterate
    or re-serialise them, so they get the parsed object, held to the request body's nesting bound
    (parsing or templating deeper JSON recurses past Python's limit)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    if nested_deeper_than(function["arguments"], MAX_JSON_DEPTH):
        raise APIError(400, f"Invalid value for '{param}.function.arguments': the JSON is nested too deeply (at "
                       f"most {MAX_JSON_DEPTH} levels of arrays and objects).", param=f"{param}.function.arguments",
                       code="invalid_value")
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def check_template_kwargs(kwargs: dict[str, Any] | None, trust_template: bool) -> None:
    """A 400 naming the first key of ``chat_template_kwargs`` that is not a template variable."""
    for key in kwargs or {}:
        if key == TEMPLATE_KEY and not trust_template:
            raise APIError(400, "chat_template_kwargs.chat_template: this server does not accept a chat "
                           "template from requests (the operator may allow it with "
                           "--trust-request-chat-template)", param="chat_template_kwargs.chat_template")
        if key in _SERVER_KEYS:
            raise APIError(400, f"chat_template_kwargs.{key}: not a chat template variable; the server sets "
                           f"it (tools and add_generation_prompt are request fields)",
                           param=f"chat_template_kwargs.{key}")


def chat_prompt_ids(
    tokenizer: Any, request: ChatCompletionRequest, *, max_chars: int, trust_template: bool = False
) -> list[int]:
    """The prompt's token ids; a 400 for a refused ``chat_template_kwargs`` key (see the module
    docstring) or a rendered prompt of more than ``max_chars`` characters, before tokenising it."""
    kwargs = request.chat_template_kwargs or {}
    check_template_kwargs(kwargs, trust_template)
    if not getattr(tokenizer, "chat_template", None) and TEMPLATE_KEY not in kwargs:
        raise APIError(
            400, f"The model '{request.model}' has no chat template; use /v1/completions instead.",
            param="messages",
        )
    messages = [template_message(m, f"messages.{i}") for i, m in enumerate(request.messages)]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=request.tool_dicts(),
            add_generation_prompt=request.add_generation_prompt,
            tokenize=False,
            **kwargs,
        )
    except (TemplateError, ValueError, TypeError, KeyError) as exc:  # a template's own raise_exception too
        raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages") from None
    if len(text) > max_chars:
        raise APIError(
            400, f"Invalid 'messages': the rendered prompt is too long. Expected at most {max_chars} "
            f"characters, got {len(text)}.", param="messages", code="string_above_max_length",
        )
    # The template already wrote BOS and role markers; adding special tokens again would double BOS.
    return tokenizer.encode(text, add_special_tokens=False)
