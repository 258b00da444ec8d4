"""Per-request sampling settings, validated once when the request is created."""

import json
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Self

# Temperatures this small are greedy, as in vLLM: dividing logits by 1e-40 overflows to inf and NaN.
GREEDY_BELOW = 1e-5
# Sane bounds beyond vLLM's (temperature >= 0, repetition_penalty > 0): dividing logits by a value
# near 0 or past float32's range gives inf and NaN, and the sampler would then pick garbage.
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# Integers a worker receives must fit msgpack's 64 bits; a larger one would fail the send.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Applied where the text is made (the HTTP process, or ``LLM``), never by the engine's step.
DETOKENIZER_FIELDS = ("stop", "include_stop_str_in_output", "skip_special_tokens")


class InvalidSamplingParam(ValueError):
    """A sampling setting out of its range; ``field`` names it (the HTTP 400's ``param``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _check(ok: bool, field: str, message: str) -> None:
    if not ok:
        raise InvalidSamplingParam(field, message)


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    ``temperature`` below ``GREEDY_BELOW`` (0 included) means greedy. ``top_k <= 0`` disables top-k.
    ``logprobs`` is the number of alternatives returned with each token (None: no log-probs; 0: only
    the chosen token's); ``prompt_logprobs`` the same for every prompt token (the first has none).

    ``json_schema``: the output must be JSON matching this JSON Schema (its JSON text; a dict is
    serialised here, key order kept), enforced token by token; the grammar decides where the output
    ends (``min_tokens`` does not hold it open). ``json_schema_after_token``: the grammar applies only
    after this token has been generated (a reasoning model's ``</think>``: it reasons freely, then
    answers in the schema), as vLLM applies it after the reasoning ends. ``logit_bias``: token id -> value added to its logit
    before sampling (-100 and 100 in effect forbid and force a token).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False  # keep the matched stop string / stop token's text
    skip_special_tokens: bool = True  # in the detokenized text
    json_schema: str | None = None
    json_schema_after_token: int | None = None
    logit_bias: dict[int, float] | None = None
    prompt_logprobs: int | None = None
    # vLLM's field for prefill/decode disaggregation: what a KV connector hands over or reads
    # (engines/kv/mooncake_connector.py); checked by the engine, which knows its connector.
    kv_transfer_params: dict[str, Any] | None = None
    # The LoRA adapter the request runs with (a name the engine loaded: engines/lora/); None: the base model.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.json_schema, dict):
            self.json_schema = json.dumps(self.json_schema)
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(t): float(v) for t, v in dict(self.logit_bias).items()} or None
            except (TypeError, ValueError):
                raise InvalidSamplingParam("logit_bias", "logit_bias must map token ids to numbers") from None
        self.validate()

    def validate(self) -> None:
        """Raise ``InvalidSamplingParam`` naming the bad field; the server turns it into a 400.

        Every float range is a closed finite interval, written so that NaN fails it too (every
        comparison with NaN is false): the sampler's logits stay finite for any accepted value."""
        _check(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        _check(0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
               f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(0 <= self.top_k <= INT64_MAX, "top_k",
               f"top_k must be 0 (disabled) or positive (64-bit), got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty",
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        low, high = REPETITION_PENALTY_RANGE
        _check(low <= self.repetition_penalty <= high, "repetition_penalty",
               f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty}")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(0 <= self.min_tokens <= INT64_MAX, "min_tokens",
               f"min_tokens must be non-negative (64-bit), got {self.min_tokens}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
               f"logprobs must be in [0, 20], got {self.logprobs}")
        _check(self.seed is None or INT64_MIN <= self.seed <= INT64_MAX, "seed",
               f"seed must be a 64-bit signed integer, got {self.seed}")
        _check(all(self.stop), "stop", "stop strings must be non-empty")
        _check(all(0 <= t <= INT64_MAX for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be token ids (non-negative 64-bit integers)")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20, "prompt_logprobs",
               f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}")
        _check(self.json_schema is None or isinstance(self.json_schema, str), "json_schema",
               "json_schema must be a JSON Schema (its JSON text or a dict)")
        _check(all(-100 <= v <= 100 for v in (self.logit_bias or {}).values()), "logit_bias",
               "logit_bias values must be in [-100, 100]")
        _check(self.kv_transfer_params is None or isinstance(self.kv_transfer_params, dict), "kv_transfer_params",
               "kv_transfer_params must be an object")

    @classmethod
    def trusted(cls, **values: Any) -> Self:
        """Params validated where they were made (``SamplingParams(...)`` at the HTTP edge), rebuilt
        without ``__post_init__`` (the worker, from its ``Add`` message): nothing is validated again.
        A field not given takes its default."""
        params = object.__new__(cls)
        for f in fields(cls):
            if f.name in values:
                value = values.pop(f.name)
            else:
                value = f.default_factory() if f.default is MISSING else f.default
            setattr(params, f.name, value)
        if values:
            raise TypeError(f"unknown sampling fields: {sorted(values)}")
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        """Whether the logits depend on the tokens seen so far (the sampler then needs them)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0
