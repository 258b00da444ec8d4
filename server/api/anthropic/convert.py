"""An Anthropic Messages request as the chat completions request it means: one request path.

``system`` becomes a system message; a user turn's ``tool_result`` blocks become ``tool`` messages
(in order, around its text); an assistant turn's ``tool_use`` blocks become its ``tool_calls``;
``tool_choice`` ``any`` is ``required`` and ``tool`` a named function, so forced calls go through the
same grammar, as ``output_config.format`` is a json_schema ``response_format``; a conversation that ends
with an assistant turn is continued (a prefill), not answered.
"""

import json
from typing import Any

from pydantic import ValidationError

from xinserve.server.api.anthropic.protocol import CountTokensRequest, Message, MessagesRequest, ToolChoice
from xinserve.server.api.openai.protocol import ChatCompletionRequest
from xinserve.server.errors import APIError

# The chat field a validation error names -> the Messages API field the client sent.
_PARAMS = {"stop": "stop_sequences", "user": "metadata.user_id"}


def chat_request(body: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request; a 400 (naming the Messages API field) when it is not a valid one."""
    messages: list[dict[str, Any]] = []
    system = body.system_text()
    if system is not None:
        messages.append({"role": "system", "content": system})
    for message in body.messages:
        messages.extend(_chat_messages(message))
    fields: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        fields["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {}),
        }} for t in body.tools]
    if body.tool_choice is not None:
        fields["tool_choice"] = _tool_choice(body.tool_choice)
        fields["parallel_tool_calls"] = not body.tool_choice.disable_parallel_tool_use
    if body.messages[-1].role == "assistant":
        # A prefill: the answer continues the last assistant turn (Hugging Face's continue_final_message).
        fields["add_generation_prompt"] = False
        fields["chat_template_kwargs"] = {"continue_final_message": True}
    if isinstance(body, MessagesRequest):
        fields.update(max_tokens=body.max_tokens, stream=body.stream)
        optional = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k,
                    "stop": body.stop_sequences, "user": body.metadata.user_id if body.metadata else None}
        fields.update({k: v for k, v in optional.items() if v is not None})
        if body.output_config is not None and body.output_config.format is not None:
            # Structured outputs: the chat path's json_schema response format, the same grammar.
            fields["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "output", "schema": body.output_config.format.schema_}}
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        param = _PARAMS.get(loc[0], ".".join(loc)) if loc else None
        msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        raise APIError(400, f"Invalid value for '{param}': {msg}" if param else msg, param=param) from None


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        text = "\n".join(b.text for b in message.content if b.type == "text")
        calls = [{"id": b.id, "type": "function",
                  "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                 for b in message.content if b.type == "tool_use"]
        return [{"role": "assistant", "content": text or (None if calls else ""), **({"tool_calls": calls} if calls else {})}]
    # A user turn: its tool results and its text, in the order sent (results usually come first).
    # Text blocks join with newlines, as a chat message's text parts do (``ChatMessage.text``).
    out: list[dict[str, Any]] = []
    for block in message.content:
        if block.type == "tool_result":
            # Chat templates have no error flag for a tool's answer: the text says it.
            text = f"Error: {block.text()}" if block.is_error else block.text()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += "\n" + block.text
        else:
            out.append({"role": "user", "content": block.text})
    return out


def _tool_choice(choice: ToolChoice) -> str | dict[str, Any]:
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
