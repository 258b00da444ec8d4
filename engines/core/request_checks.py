"""What makes a new generation request one that could never run, checked before it is queued (the
server answers each with a 400): a prompt that is empty, leaves no room to generate or leaves the
vocabulary, and sampling fields that index the vocabulary inside the step (a bad one would fail every
request in the batch)."""

from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.engines.structured.schema import check_json_schema


def check_prompt(prompt_token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    if not prompt_token_ids:
        raise ValueError("the prompt is empty")
    if len(prompt_token_ids) >= max_model_len:
        raise ValueError(
            f"the prompt has {len(prompt_token_ids)} tokens, but this model's context is "
            f"{max_model_len} tokens and at least one must be left to generate"
        )
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")


def check_token_fields(params: SamplingParams, vocab_size: int) -> None:
    """The fields that name token ids or count them against the vocabulary, and the JSON schema."""
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be in [0, {vocab_size})")
    if max(params.logprobs or 0, params.prompt_logprobs or 0) > vocab_size:
        raise ValueError(f"logprobs and prompt_logprobs must be at most the vocabulary size {vocab_size}")
    if params.logit_bias and any(not 0 <= t < vocab_size for t in params.logit_bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size})")
    if params.json_schema is not None:
        check_json_schema(params.json_schema)
    after = params.json_schema_after_token
    if after is not None and not 0 <= after < vocab_size:
        raise ValueError(f"json_schema_after_token must be in [0, {vocab_size})")
