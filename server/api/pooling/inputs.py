"""A pooling request's inputs: checked before any tokenising, then tokenised (a string as /v1/completions
encodes its prompt; token ids as given) and fitted to the context (``truncate_prompt_tokens``: keep the
last N tokens, -1: the model's context, as vLLM does; else an input longer than the context is a 400)."""

from typing import Any

from xinserve.server.api.tokenize.prompt_tokens import encode_prompt
from xinserve.server.config import LimitsSettings
from xinserve.server.errors import APIError

Input = str | list[int]


def input_list(value: str | list[str] | list[int] | list[list[int]], param: str = "input") -> list[Input]:
    """OpenAI's ``input``: a string, strings, token ids or lists of token ids -> one entry per input."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(item, int) for item in value):
        return [value]  # one input of token ids
    return list(value)


def check_inputs(inputs: list[Input], limits: LimitsSettings, param: str = "input") -> None:
    """400 for no input, too many, an empty one, or more text than ``max_prompt_chars`` in all."""
    if not inputs:
        raise APIError(400, f"'{param}' must not be empty.", param=param, code="empty_input")
    if len(inputs) > limits.max_pooling_inputs:
        raise APIError(400, f"'{param}' has {len(inputs)} inputs; at most {limits.max_pooling_inputs} are allowed "
                       "per request (limits.max_pooling_inputs).", param=param, code="too_many_inputs")
    chars = 0
    for i, item in enumerate(inputs):
        if isinstance(item, list) and not all(isinstance(t, int) for t in item):
            raise APIError(400, f"'{param}[{i}]' must be a string or a list of token ids.", param=param)
        if len(item) == 0:
            raise APIError(400, f"'{param}[{i}]' is empty.", param=param, code="empty_input")
        chars += len(item) if isinstance(item, str) else 0
    if chars > limits.max_prompt_chars:
        raise APIError(400, f"'{param}' is too long: {chars} characters, at most {limits.max_prompt_chars} "
                       "(limits.max_prompt_chars).", param=param, code="string_above_max_length")


def tokenize(tokenizer: Any, inputs: list[Input], param: str = "input") -> list[list[int]]:
    """Each input's ids; 400 for a token id outside the tokenizer's vocabulary."""
    size = len(tokenizer)
    out = []
    for item in inputs:
        if isinstance(item, str):
            out.append(encode_prompt(tokenizer, item))
            continue
        bad = next((t for t in item if not 0 <= t < size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} in '{param}' is outside the vocabulary (0..{size - 1}).", param=param)
        out.append(list(item))
    return out


def fit_context(ids: list[list[int]], max_model_len: int, truncate_prompt_tokens: int | None,
                param: str = "input") -> list[list[int]]:
    """Inputs truncated to their last ``truncate_prompt_tokens`` tokens (-1: the context), or a 400
    naming the first input longer than the context."""
    if truncate_prompt_tokens is not None:
        keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        if not 1 <= keep <= max_model_len:
            raise APIError(400, f"truncate_prompt_tokens must be -1 or in [1, {max_model_len}] (the model's maximum "
                           f"context length), got {truncate_prompt_tokens}.", param="truncate_prompt_tokens")
        return [item[-keep:] for item in ids]
    for i, item in enumerate(ids):
        if len(item) > max_model_len:
            raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, "
                           f"'{param}[{i}]' has {len(item)} tokens. Please reduce the length of the input, or "
                           "set truncate_prompt_tokens.", param=param, code="context_length_exceeded")
    return ids
