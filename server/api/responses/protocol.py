"""The ``POST /v1/responses`` body. Input items stay plain dicts here: ``convert`` reads them one by one,
so an unknown item type is a 400 that names the item, not a union's validation error."""

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class _Lenient(BaseModel):
    # The SDKs send many optional fields we do not serve (include, service_tier, ...): ignored.
    model_config = ConfigDict(extra="ignore")


class FunctionTool(_Lenient):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextSettings(_Lenient):
    format: TextFormat | None = None


class ReasoningSettings(_Lenient):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(_Lenient):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    # OpenAI's documented ranges only; the engine's (max_output_tokens >= 1, ...) are checked on the chat path.
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextSettings | None = None
    reasoning: ReasoningSettings | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False  # not served: a 400
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extensions, as on chat completions
    chat_template_kwargs: dict[str, Any] | None = None
    seed: int | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        # OpenAI's limits; the metadata is stored with the response, so they bound what a request keeps.
        if value is None:
            return value
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"at most {MAX_METADATA_PAIRS} key-value pairs are allowed, got {len(value)}")
        for key, text in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS:
                raise ValueError(f"keys may have at most {MAX_METADATA_KEY_CHARS} characters, got {len(key)}")
            if len(text) > MAX_METADATA_VALUE_CHARS:
                raise ValueError(f"values may have at most {MAX_METADATA_VALUE_CHARS} characters, got {len(text)} "
                                 f"for key {key[:MAX_METADATA_KEY_CHARS]!r}")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _input_kind(cls, value: Any) -> Any:
        # Checked before the union, whose error would name a branch ("input.str"), not the problem.
        if not isinstance(value, str) and not (isinstance(value, list) and all(isinstance(i, dict) for i in value)):
            raise ValueError("input must be a string or a list of input items (objects)")
        return value
