"""Tool calls in model output: the per-family parsers of ``tool_choice: auto`` and their registry.

A parser reads a finished output and returns its content and its calls; an output that does not
parse as that family's calls (malformed JSON, a missing end tag) is content, never an error. The
server picks the parser from the model's ``tool_call_parser`` setting, else from markers in its
chat template (``detect``).
"""

from xinserve.server.api.tool_calls.base import ParsedOutput, ToolCall, ToolCallParser
from xinserve.server.api.tool_calls.deepseek_v3 import DeepSeekV3Parser
from xinserve.server.api.tool_calls.glm45 import Glm45Parser
from xinserve.server.api.tool_calls.glm47 import Glm47Parser
from xinserve.server.api.tool_calls.hermes import HermesParser
from xinserve.server.api.tool_calls.llama3 import Llama3JsonParser

PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,  # also Qwen2.5 and Qwen3
    "llama3_json": Llama3JsonParser,
    "glm45": Glm45Parser,  # also GLM-4 (a JSON body after the name)
    "glm47": Glm47Parser,  # GLM-4.7 and GLM-5: the same tags, no newlines between them
    "deepseek_v3": DeepSeekV3Parser,
}

# Template markers, most specific first: GLM-4.5's template also writes <tool_call>, and GLM-4.7's
# writes GLM-4.5's tags with nothing between a key and its value (GLM-4.5's puts a newline there).
_TEMPLATE_MARKERS = (
    ("<｜tool▁calls▁begin｜>", "deepseek_v3"),
    ("</arg_key><arg_value>", "glm47"),
    ("<arg_key>", "glm45"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
)


def detect(chat_template: str | None) -> str | None:
    """The parser name a chat template's tool-call syntax implies; None when it shows none."""
    for marker, name in _TEMPLATE_MARKERS:
        if chat_template and marker in chat_template:
            return name
    return None


def parser_for(name: str | None, chat_template: str | None, tools: list[dict]) -> ToolCallParser | None:
    """The configured parser, else the detected one, built for this request's ``tools``."""
    name = name or detect(chat_template)
    return PARSERS[name](tools) if name else None


__all__ = ["PARSERS", "ParsedOutput", "ToolCall", "ToolCallParser", "detect", "parser_for"]
