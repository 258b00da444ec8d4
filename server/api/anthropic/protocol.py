"""Anthropic Messages API request bodies as pydantic models (``/v1/messages``, ``/v1/messages/count_tokens``).

Strict about types and about which content blocks a role may send (this server serves text-only
models: ``text`` everywhere, ``tool_use`` in assistant turns, ``tool_result`` in user turns); fields we
do not know (``cache_control``, ``thinking``, ``service_tier``, ...) are ignored, as in ``server/api/openai/protocol.py``.
"""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # Anthropic's (and OpenAI's) rule for tool names
_BLOCKS_BY_ROLE = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use")}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class TextBlock(_Strict):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    @model_validator(mode="before")
    @classmethod
    def _text_results_only(cls, value: Any) -> Any:
        content = value.get("content") if isinstance(value, dict) else None
        for block in content if isinstance(content, list) else ():
            kind = block.get("type") if isinstance(block, dict) else None
            if kind != "text":
                raise ValueError(f"a tool_result's content block of type '{kind}' is not supported; "
                                 f"only 'text' blocks are (this server serves text-only models)")
        return value

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(b.text for b in self.content)


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _blocks_fit_the_role(cls, value: Any) -> Any:
        # Checked before the union, whose error would name a branch, not the problem.
        if not isinstance(value, dict) or not isinstance(value.get("content"), list):
            return value
        role = value.get("role")
        allowed = _BLOCKS_BY_ROLE.get(role) if isinstance(role, str) else None
        if allowed is None:
            return value  # the role's own error says what roles are allowed
        for block in value["content"]:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in allowed:
                raise ValueError(f"content block type '{kind}' is not supported in a '{value['role']}' message; "
                                 f"supported: {', '.join(allowed)} (this server serves text-only models)")
        return value


class ToolDefinition(_Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _custom_tools_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool type '{kind}' is not supported; only custom tools "
                             f"(name, description, input_schema) are")
        return value

    @model_validator(mode="after")
    def _object_schema(self) -> "ToolDefinition":
        if self.input_schema.get("type") != "object":
            raise ValueError(f"tool '{self.name}': input_schema must be a JSON schema of type 'object'")
        return self


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _name_for_tool(self) -> "ToolChoice":
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs the tool's 'name'")
        return self


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """Structured outputs: ``format`` forces a JSON schema on the text (``effort`` is ignored)."""

    format: OutputFormat | None = None


class Metadata(_Strict):
    user_id: str | None = None


class CountTokensRequest(_Strict):
    """What a prompt is made of: the body of ``/v1/messages/count_tokens``."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None

    @model_validator(mode="after")
    def _tool_choice_fits_tools(self) -> "CountTokensRequest":
        choice, names = self.tool_choice, [t.name for t in self.tools or []]
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise ValueError(f"tool_choice of type '{choice.type}' needs tools")
        if choice is not None and choice.type == "tool" and choice.name not in names:
            raise ValueError(f"tool_choice names the tool '{choice.name}', which is not in tools")
        return self

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        return "\n".join(b.text for b in self.system)


class MessagesRequest(CountTokensRequest):
    """The body of ``/v1/messages``: a prompt plus how to sample its answer."""

    # Anthropic's documented ranges only; the engine's are checked on the chat path (SamplingParams.validate).
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: Metadata | None = None
    stream: bool = False
    output_config: OutputConfig | None = None

    @model_validator(mode="after")
    def _one_grammar(self) -> "MessagesRequest":
        forced = self.tool_choice is not None and self.tool_choice.type in ("any", "tool")
        if forced and self.output_config is not None and self.output_config.format is not None:
            raise ValueError("output_config.format cannot be combined with a tool_choice that forces tool use")
        return self
