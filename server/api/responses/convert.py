"""Responses input -> the chat request chat completions runs; the answer -> chat messages to keep.

Input items: messages (``role`` + a string or ``input_text`` / ``output_text`` parts), ``function_call``
(an assistant's call; consecutive calls form one assistant turn), ``function_call_output`` (a
``tool`` message) and ``reasoning`` (past reasoning: dropped, as chat templates drop it). Any other
item or part is a 400 naming it.
"""

from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from xinserve.server.api.openai.protocol import ChatCompletionRequest
from xinserve.server.api.responses.protocol import ResponsesRequest
from xinserve.server.errors import APIError, validation_error

_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's own input as chat messages (without ``instructions``)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        kind = item.get("type", "message" if "role" in item else None)
        param = f"input[{i}]"
        if kind == "message":
            messages.append(_message(item, param))
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", param), "type": "function",
                    "function": {"name": _text(item, "name", param), "arguments": _text(item, "arguments", param)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):  # output as content parts
                output = "\n".join(_part_text(p, f"{param}.output") for p in output)
            if not isinstance(output, str):
                raise APIError(400, f"'{param}.output' must be a string", param=f"{param}.output")
            messages.append({"role": "tool", "content": output, "tool_call_id": _text(item, "call_id", param)})
        elif kind == "reasoning":
            continue
        else:
            raise APIError(400, f"Invalid '{param}.type': item type {kind!r} is not supported; use message, "
                           f"function_call, function_call_output or reasoning items.", param=f"{param}.type",
                           code="invalid_value")
    return messages


def _message(item: dict[str, Any], param: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in _ROLES:
        raise APIError(400, f"Invalid '{param}.role': {role!r}; expected one of {', '.join(_ROLES)}.",
                       param=f"{param}.role", code="invalid_value")
    content = item.get("content")
    if isinstance(content, list):
        content = "\n".join(_part_text(p, f"{param}.content") for p in content)
    if not isinstance(content, str):
        raise APIError(400, f"'{param}.content' must be a string or a list of text parts", param=f"{param}.content")
    return {"role": role, "content": content}


def _part_text(part: Any, param: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
        raise APIError(400, f"Invalid '{param}': content part type {kind!r} is not supported: this server serves "
                       f"text-only models (input_text and output_text parts).", param=param, code="invalid_value")
    return part["text"]


def _text(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise APIError(400, f"Missing or invalid '{param}.{key}': a string is required.", param=f"{param}.{key}")
    return value


# The chat fields that Responses fields become (``chat_request``), for errors the chat path raises.
# The chat messages' indices are not the input's (the stored conversation and the instructions come
# first), so any message's field is "input".
_CHAT_FIELDS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "response_format": "text.format"}


def responses_error(err: APIError) -> APIError:
    """``err``, raised on the chat path (its checks, limits, template, context), naming the Responses
    field the chat field came from; an error naming no converted field as it is."""
    head = (err.param or "").split(".")[0]
    field = _CHAT_FIELDS.get(head)
    if field is None:
        return err
    if head == "messages":  # a plain word too ("too many messages"): renamed only where quoted
        param = field
        message = err.message.replace(f"'{err.param}'", f"'{param}'").replace(f"'{head}'", f"'{field}'")
    else:  # an identifier (max_completion_tokens, response_format): renamed wherever it appears
        param = field + err.param[len(head):]
        message = err.message.replace(head, field)
    return APIError(err.status, message, param=param, code=err.code, type=err.type)


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request this response runs as; ``messages``: the stored conversation plus the input."""
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    kwargs = dict(body.chat_template_kwargs or {})
    if body.reasoning is not None and body.reasoning.effort is not None:
        kwargs["reasoning_effort"] = body.reasoning.effort  # for templates that take it (gpt-oss, GLM-5, ...)
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "stream": body.stream,
        "parallel_tool_calls": body.parallel_tool_calls, "chat_template_kwargs": kwargs or None,
    }
    for key, value in (("max_completion_tokens", body.max_output_tokens), ("temperature", body.temperature),
                       ("top_p", body.top_p), ("seed", body.seed), ("user", body.user)):
        if value is not None:
            chat[key] = value
    if body.tools:
        chat["tools"] = [_tool(t.model_dump(exclude_none=True), i) for i, t in enumerate(body.tools)]
    if body.tool_choice is not None:
        chat["tool_choice"] = _tool_choice(body.tool_choice)
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type != "text":
        chat["response_format"] = {"type": fmt.type}
        if fmt.type == "json_schema":
            schema = {"name": fmt.name or "response", "schema": fmt.schema_ or {"type": "object"}}
            chat["response_format"]["json_schema"] = schema
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise validation_error(RequestValidationError(exc.errors())) from None


def _tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    if tool["type"] != "function" or "name" not in tool:
        raise APIError(400, f"Invalid 'tools[{i}]': tool type {tool['type']!r} is not supported; only function "
                       f"tools (with a name) are.", param=f"tools[{i}]", code="invalid_value")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    return {"type": "function", "function": function}


def _tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                           "{\"type\": \"function\", \"name\": ...}", param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def answer_message(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant turn a response adds to its conversation (kept for ``previous_response_id``)."""
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [{"id": c["call_id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in calls]
    elif not content:
        message["content"] = ""
    return message
