"""OpenAI chat messages -> prompt token ids through the model's own chat template."""

import json
from typing import Any

from jinja2 import TemplateError

from server.errors import APIError
from server.protocol import ChatCompletionRequest, ChatMessage


def template_message(message: ChatMessage) -> dict[str, Any]:
    """The dict a Hugging Face chat template expects; "developer" is rendered as "system"."""
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": message.text(),
    }
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """OpenAI sends a call's arguments as JSON text; chat templates (Qwen's, Llama's, GLM's) iterate
    or re-serialise them, so they get the parsed object."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": arguments}}


def chat_prompt_ids(tokenizer: Any, request: ChatCompletionRequest) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(
            400, f"The model '{request.model}' has no chat template; use /v1/completions instead.",
            param="messages",
        )
    messages = [template_message(m) for m in request.messages]
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=request.tool_dicts(),
            add_generation_prompt=request.add_generation_prompt,
            tokenize=False,
            **(request.chat_template_kwargs or {}),
        )
    except (TemplateError, ValueError, TypeError, KeyError) as exc:  # a template's own raise_exception too
        raise APIError(400, f"The chat template rejected the messages: {exc}", param="messages") from None
    # The template already wrote BOS and role markers; adding special tokens again would double BOS.
    return tokenizer.encode(text, add_special_tokens=False)
