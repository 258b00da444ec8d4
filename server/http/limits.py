"""The operator's per-request limits (the config's ``limits`` section), checked in the handlers.

The request models are static pydantic classes and the limits belong to one app's config, so
they are checked here, after validation and before any tokenising, as a 400 naming the field.
The body size limit is the ASGI middleware in ``server/http/body_limit.py``.
"""

from xinserve.server.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from xinserve.server.config import LimitsSettings
from xinserve.server.errors import APIError


def check_chat(body: ChatCompletionRequest, limits: LimitsSettings) -> None:
    if len(body.messages) > limits.max_messages:
        raise APIError(
            400, f"Invalid 'messages': array too long. Expected at most {limits.max_messages} messages, "
            f"got {len(body.messages)}.", param="messages", code="array_above_max_length",
        )
    chars = sum(m.prompt_chars() for m in body.messages)
    _check_prompt_chars(chars, limits, "messages")
    _check_sampling(body, body.requested_max_tokens, body.max_tokens_param, limits)


def check_completion(body: CompletionRequest, limits: LimitsSettings) -> None:
    chars = sum(len(p) for p in body.prompts() if isinstance(p, str))
    _check_prompt_chars(chars, limits, "prompt")
    # OpenAI's implicit default of 16 is capped later (``cap_max_tokens``), not refused.
    asked = body.max_tokens if "max_tokens" in body.model_fields_set else None
    _check_sampling(body, asked, "max_tokens", limits)


def cap_max_tokens(max_tokens: int, limits: LimitsSettings) -> int:
    """A budget the client did not ask for (the rest of the context, or a default), within the cap."""
    return max_tokens if limits.max_tokens is None else min(max_tokens, limits.max_tokens)


def _check_prompt_chars(chars: int, limits: LimitsSettings, param: str) -> None:
    if chars > limits.max_prompt_chars:
        raise APIError(
            400, f"Invalid '{param}': the prompt is too long. Expected at most {limits.max_prompt_chars} "
            f"characters, got {chars}.", param=param, code="string_above_max_length",
        )


def _check_sampling(
    body: ChatCompletionRequest | CompletionRequest, max_tokens: int | None, param: str, limits: LimitsSettings
) -> None:
    if body.n > limits.max_n:
        raise APIError(400, f"Invalid 'n': expected at most {limits.max_n}, got {body.n}.", param="n",
                       code="integer_above_max_value")
    if limits.max_tokens is not None and max_tokens is not None and max_tokens > limits.max_tokens:
        raise APIError(400, f"Invalid '{param}': expected at most {limits.max_tokens}, got {max_tokens}.",
                       param=param, code="integer_above_max_value")
    for stop in body.stop_list:
        if len(stop) > limits.max_stop_chars:
            raise APIError(
                400, f"Invalid 'stop': a stop sequence may have at most {limits.max_stop_chars} characters, "
                f"got {len(stop)}.", param="stop", code="string_above_max_length",
            )
