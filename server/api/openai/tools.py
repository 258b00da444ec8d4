"""What a chat request's tools and response_format ask of the output: the grammar the engine must
enforce (a JSON schema, or none) and how each choice's text is read back (content, tool calls)."""

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xinserve.server.api.openai.protocol import ChatCompletionRequest, checked_schema
from xinserve.server.api.tool_calls import parser_for
from xinserve.server.api.tool_calls.forced import NamedCall, RequiredCalls, parameters_schema, required_schema
from xinserve.server.api.tool_calls.stream import ParsedCalls, PlainText

# Any JSON object, for response_format json_object.
JSON_OBJECT = json.dumps({"type": "object"})


@dataclass(slots=True)
class OutputPlan:
    json_schema: str | None  # the engine's grammar
    new_reader: Callable[[], Any]  # one reader per choice: PlainText, NamedCall, RequiredCalls, ParsedCalls


def plan_output(body: ChatCompletionRequest, tool_call_parser: str | None, chat_template: str | None) -> OutputPlan:
    """Raises APIError (400) for a schema that cannot be enforced, naming where it came from."""
    functions = {t.function.name: t.function.model_dump(exclude_none=True) for t in body.tools or []}
    named = body.named_tool
    if named is not None:
        schema = checked_schema(parameters_schema(functions[named]), "tools.function.parameters")
        return OutputPlan(schema, lambda: NamedCall(named))
    if body.tool_choice == "required":
        schema = checked_schema(required_schema(list(functions.values()), body.parallel_tool_calls),
                                "tools.function.parameters")
        return OutputPlan(schema, RequiredCalls)
    schema = _response_format_schema(body)
    tools = body.tool_dicts()
    if tools and body.tool_choice != "none":
        parser = parser_for(tool_call_parser, chat_template, tools)
        if parser is not None:
            return OutputPlan(schema, lambda: ParsedCalls(parser))
    return OutputPlan(schema, PlainText)


def _response_format_schema(body: ChatCompletionRequest) -> str | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return JSON_OBJECT
    return checked_schema(fmt.json_schema.schema_ or {"type": "object"}, "response_format.json_schema.schema")
