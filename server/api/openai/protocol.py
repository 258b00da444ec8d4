"""OpenAI request bodies as pydantic models, with vLLM's extra sampling fields.

Validation is strict about types (a string temperature is a 400, not silently coerced) and checks
only the value ranges OpenAI documents (its schema: temperature 0..2, top_p 0..1, n 1..128, ...).
Every other range (vLLM's extras, max_tokens >= 1, seed and token ids within 64 bits, non-empty stop
strings) is the engine's, checked once by ``SamplingParams.validate`` when ``sampling_params`` builds
the engine's record, and raised as the same 400 naming the field. Fields we do not know are ignored,
as the SDK adds new optional ones often. Responses are built as plain dicts in
``server/api/openai/view.py`` (cheaper per stream chunk).
"""

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from xinserve.engines.core.sampling_params import InvalidSamplingParam, SamplingParams
from xinserve.engines.structured.schema import check_json_schema
from xinserve.server.errors import APIError
from xinserve.server.http.heavy_imports import load

# OpenAI's own API limits; the operator's limits are the config's ``limits`` section.
MAX_STOP_STRINGS = 4
MAX_TOP_LOGPROBS = 20  # chat ``top_logprobs``
MAX_COMPLETION_LOGPROBS = 5  # completions ``logprobs``
MAX_LOGIT_BIAS = 300


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _only_text(self) -> "TextPart":
        if self.type != "text":
            raise ValueError(f"content part type '{self.type}' is not supported; only 'text' parts are")
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' field")
        return self


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system"; "function" (deprecated) is not supported.
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, value: Any) -> Any:
        # Checked before the str-or-parts union, whose error would name a branch, not the problem.
        if isinstance(value, list):
            for part in value:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind is not None and kind != "text":
                    raise ValueError(f"content part type '{kind}' is not supported: this server serves "
                                     f"text-only models, so only 'text' parts are accepted")
        return value

    @model_validator(mode="after")
    def _content_present(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a '{self.role}' message needs 'content'")
        return self

    def text(self) -> str:
        """The content as one string; text parts are joined by newlines (as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text or "" for part in self.content)

    def prompt_chars(self) -> int:
        """The characters this message brings to the prompt before templating: its text and its tool
        calls' names and arguments (``limits.max_prompt_chars`` counts them all)."""
        return len(self.text()) + sum(map(_call_chars, self.tool_calls or ()))


def _call_chars(call: dict[str, Any]) -> int:
    function = call.get("function")
    if not isinstance(function, dict):
        return 0
    # Arguments sent as an object rather than a JSON string are bounded by the rendered prompt's check.
    return sum(len(v) for v in (function.get("name"), function.get("arguments")) if isinstance(v, str))


_NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # OpenAI's rule for function and schema names


class FunctionDefinition(_Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=_NAME)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def checked_schema(schema: dict[str, Any], param: str) -> str:
    """The schema as JSON text for the engine; a 400 naming ``param`` when it cannot be enforced."""
    text = json.dumps(schema)
    load("xgrammar")  # the check's converter, imported on first use (server/http/heavy_imports.py)
    try:
        check_json_schema(text)
    except ValueError as exc:
        raise APIError(400, f"Invalid schema for {param}: {exc}", param=param) from None
    return text


class _SamplingFields(_Strict):
    """Fields shared by chat and completions, in OpenAI's documented ranges, plus vLLM's extras (whose
    ranges are the engine's alone: ``SamplingParams.validate``)."""

    model: str
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions.
    top_k: int | None = None  # -1 (vLLM's "disabled") is the engine's 0
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's prefill/decode disaggregation protocol (docs/disaggregation.md); the engine checks its content.
    kv_transfer_params: dict[str, Any] | None = None
    # SGLang's (sglang-router --pd-disaggregation; server/disagg/bootstrap.py).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stops)}")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if not value:
            return value
        if len(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"at most {MAX_LOGIT_BIAS} logit_bias entries are allowed, got {len(value)}")
        for key, bias in value.items():
            # The token ids' upper bound is the model's vocabulary: ``check_vocab``, once routed.
            # ASCII digits only: str.isdigit() also holds for "²", which int() then refuses.
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}")
        return value

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the client sent, within the routed model's vocabulary: a 400 naming the field
        here rather than the worker's refusal after a round trip."""
        for param, ids in (("stop_token_ids", self.stop_token_ids or ()),
                           ("logit_bias", map(int, self.logit_bias or ()))):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise APIError(400, f"{param} token id {bad} is outside the vocabulary (0..{vocab_size - 1})",
                               param=param)

    @property
    def stop_list(self) -> list[str]:
        # ``_check_stop`` has normalised a single string into a list.
        return list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def max_tokens_param(self) -> str:
        """The field the client's token budget came from (chat's newer name overrides it)."""
        return "max_tokens"

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, json_schema: str | None = None, prompt_logprobs: int | None = None
    ) -> SamplingParams:
        """The engine's ``SamplingParams``, built here so a value out of the engine's ranges is a 400
        naming its field before any round trip to a worker (which receives the same record).
        ``max_tokens``: the budget in effect (asked for, or what the context leaves), which
        ``min_tokens`` may not exceed (as in vLLM)."""
        try:
            return SamplingParams(
                n=self.n,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k in (None, -1) else self.top_k,  # vLLM's -1 for "disabled" is the engine's 0
                min_p=self.min_p or 0.0,
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                seed=self.seed,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                # Stop strings are matched in the HTTP process by the detokenizer, not by the engine.
                stop=self.stop_list,
                stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                json_schema=json_schema,
                logit_bias={int(t): v for t, v in self.logit_bias.items()} if self.logit_bias else None,
                prompt_logprobs=prompt_logprobs,
                kv_transfer_params=self.kv_transfer_params,
            )
        except InvalidSamplingParam as exc:
            param, message = exc.field, str(exc)
            if param == "max_tokens":  # named as the client sent it (max_completion_tokens, ...)
                param, message = self.max_tokens_param, message.replace("max_tokens", self.max_tokens_param)
            raise APIError(400, f"Invalid value for '{param}': {message}", param=param,
                           code="invalid_value") from None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    # vLLM extensions for chat templates.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        """Cross-field rules, raised as a 400 naming the field (pydantic would name none)."""
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if self.response_format and self.response_format.type == "json_schema" and not self.response_format.json_schema:
            raise APIError(400, "response_format type 'json_schema' needs a 'json_schema' object",
                           param="response_format.json_schema")
        if self.tool_choice == "required" and not self.tools:
            raise APIError(400, "tool_choice 'required' needs tools", param="tool_choice")
        named = self.named_tool
        if named is not None and named not in {t.function.name for t in self.tools or []}:
            raise APIError(400, f"tool_choice names the function '{named}', which is not in tools",
                           param="tool_choice")
        if self.forces_tool_calls and self.response_format and self.response_format.type != "text":
            raise APIError(400, "response_format cannot be combined with a tool_choice that forces tool calls",
                           param="response_format")

    @property
    def named_tool(self) -> str | None:
        """The function a ``{"type": "function", "function": {"name": ...}}`` tool_choice names."""
        if not isinstance(self.tool_choice, dict):
            return None
        function = self.tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if self.tool_choice.get("type") != "function" or not isinstance(name, str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                           "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
        return name

    @property
    def forces_tool_calls(self) -> bool:
        return self.tool_choice == "required" or isinstance(self.tool_choice, dict)

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template and the tool-call parsers read them."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def requested_max_tokens(self) -> int | None:
        # ``max_completion_tokens`` is the newer name and wins when both are given.
        return self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = None  # served only equal to n (``check``)
    suffix: str | None = None

    def check(self) -> None:
        """Cross-field rules, raised as a 400 naming the field (pydantic would name none)."""
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise APIError(400, "prompt must not be an empty list", param="prompt")
            if any(isinstance(p, list) and not p for p in self.prompt):
                raise APIError(400, "a token-id prompt must not be empty", param="prompt")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of different from n is not supported by this server", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        for param in ("kv_transfer_params", "bootstrap_room"):
            if getattr(self, param) is not None and len(self.prompts()) != 1:
                raise APIError(400, f"{param} needs a single prompt", param=param)

    @property
    def prompt_logprobs(self) -> int | None:
        """Echoed prompt tokens carry log-probs too when log-probs are asked for."""
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # one token-id prompt
        return list(p)
